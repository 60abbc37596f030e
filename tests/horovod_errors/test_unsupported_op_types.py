"""An op a collective or tensor kind cannot take raises the exception class Horovod raises there.

Horovod 0.28.1: torch's reducescatter with op=Adasum (or Min/Max/Product) raises RuntimeError;
TensorFlow's allreduce of IndexedSlices with Min/Max/Product/Adasum raises NotImplementedError
(a RuntimeError). hora raised ValueError in both. Users' ``except`` clauses follow Horovod's types,
so hora's error is a NotImplementedError (hence a RuntimeError) and still a ValueError, as before.
Each check runs the binding for real in a one-rank job (hora.init() with no launcher).
"""

from __future__ import annotations

import numpy as np
import pytest

import hora
from hora.errors import HoraError
from hora.horovod_args import check_sum_or_average

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_the_shared_rule_raises_horovods_types(op: str) -> None:
    with pytest.raises(NotImplementedError, match="reducescatter") as info:
        check_sum_or_average(getattr(hora, op), "reducescatter")
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    assert isinstance(info.value, HoraError)


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_numpy_reducescatter_with_an_op_it_cannot_take(uninitialised, op: str) -> None:
    hora.init()
    with pytest.raises(RuntimeError, match="op=Average and op=Sum only"):
        hora.reducescatter(np.ones(4), op=getattr(hora, op))


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_torch_reducescatter_with_an_op_it_cannot_take_raises_runtime_error(uninitialised, op: str) -> None:
    torch = pytest.importorskip("torch")
    import hora.torch as hvd

    hvd.init()
    with pytest.raises(RuntimeError, match="op=Average and op=Sum only"):
        hvd.reducescatter(torch.ones(4), op=getattr(hvd, op))
    with pytest.raises(RuntimeError):
        hvd.grouped_reducescatter([torch.ones(4)], op=getattr(hvd, op))


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_tensorflow_indexed_slices_with_an_op_they_cannot_take_raise_not_implemented(uninitialised, op: str) -> None:
    tf = pytest.importorskip("tensorflow")
    import hora.tensorflow as hvd

    hvd.init()
    slices = tf.IndexedSlices(tf.ones((2, 3)), tf.constant([0, 2]), dense_shape=tf.constant([4, 3]))
    with pytest.raises(NotImplementedError):
        hvd.allreduce(slices, op=getattr(hvd, op))


def test_a_cross_rank_disagreement_is_a_runtime_error_and_not_a_peer_failure() -> None:
    """Horovod's type in torch and MXNet; not HorovodInternalError, which elastic training would retry."""
    from hora.errors import CollectivePreconditionError, HorovodInternalError

    assert issubclass(CollectivePreconditionError, RuntimeError) and issubclass(CollectivePreconditionError, HoraError)
    assert not issubclass(CollectivePreconditionError, HorovodInternalError)


def test_tensorflow_raises_a_disagreement_as_failed_precondition_with_its_code() -> None:
    tf = pytest.importorskip("tensorflow")
    from hora.errors import CollectivePreconditionError
    from hora.tensorflow.error_types import HoraFailedPreconditionError

    error = HoraFailedPreconditionError.from_hora(CollectivePreconditionError("Mismatched allreduce shapes"))
    assert isinstance(error, tf.errors.FailedPreconditionError) and isinstance(error, CollectivePreconditionError)
    assert error.error_code == tf.errors.FAILED_PRECONDITION and error.message == "Mismatched allreduce shapes"
    # An UnknownError without hora's marker stays exactly that.
    plain = tf.errors.UnknownError(None, None, "something else")
    assert type(plain) is tf.errors.UnknownError and plain.error_code == tf.errors.UNKNOWN
