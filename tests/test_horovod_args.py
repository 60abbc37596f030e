"""Horovod's argument rules, as every binding applies them (hora.horovod_args); no job is started."""

from __future__ import annotations

import warnings

import pytest

import hora
from hora.basics import ProcessSet
from hora.horovod_args import (
    GradientReduction,
    backward_passes,
    check_compression,
    check_sum_or_average,
    group_positions,
    order_as_reference,
    partition,
    resolve_groups,
    resolve_op,
    split_evenly,
)
from hora.transport.base import ELEMENTWISE_OPS, ReduceOp

pytestmark = pytest.mark.timeout(30)


def test_reduce_ops_are_one_type_with_horovods_values():
    values = {"Average": 0, "Sum": 1, "Adasum": 2, "Min": 3, "Max": 4, "Product": 5}
    for name, value in values.items():
        op = getattr(hora, name)
        assert isinstance(op, ReduceOp) and op == value
    assert ReduceOp.AVERAGE not in ELEMENTWISE_OPS and ReduceOp.ADASUM not in ELEMENTWISE_OPS


def test_op_resolution_follows_horovod():
    assert resolve_op(None) is ReduceOp.AVERAGE
    assert resolve_op(1) is ReduceOp.SUM  # a plain int with Horovod's value
    with pytest.warns(DeprecationWarning, match="average"):
        assert resolve_op(None, average=False) is ReduceOp.SUM
    with pytest.raises(ValueError, match="not both"):
        resolve_op(hora.Sum, average=True)
    assert resolve_op(hora.Adasum) is ReduceOp.ADASUM
    with pytest.raises(ValueError, match="unknown reduce op"):
        resolve_op(17)
    with pytest.raises(ValueError, match="reducescatter: hora supports op=Average and op=Sum only"):
        check_sum_or_average(hora.Max, "reducescatter")


def test_predivide_splits_the_average_and_needs_average():
    ps = ProcessSet([0, 1, 2, 3])
    reduction = GradientReduction.create(hora.Average, 4.0, ps)
    assert (reduction.prescale_factor, reduction.postscale_factor) == (0.25, 4.0)
    assert reduction.sparse_scale() == pytest.approx(0.25)  # 1/4 * 4 / 4 ranks
    assert GradientReduction.create(hora.Sum, 1.0, ps).sparse_scale() == 1.0
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        GradientReduction.create(hora.Sum, 2.0, ps)
    with pytest.raises(ValueError, match="op=Average and op=Sum only"):
        GradientReduction.create(hora.Max, 1.0, ps).sparse_scale()


def test_backward_passes_must_be_positive():
    assert backward_passes(3) == 3
    with pytest.raises(ValueError, match="at least 1"):
        backward_passes(0)


def test_num_groups_warns_and_groups_wins():
    with pytest.warns(DeprecationWarning, match="num_groups=2 is ignored"):
        assert resolve_groups(2, 3) == 3
    with pytest.warns(DeprecationWarning, match="pass groups=2"):
        assert resolve_groups(2, None) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_groups(0, None) is None and resolve_groups(0, 0) is None
    with pytest.raises(ValueError, match="non-negative"):
        resolve_groups(0, -1)
    with pytest.raises(ValueError, match="list of lists"):
        resolve_groups(0, "ab")


def test_groups_split_and_partition():
    assert [len(g) for g in split_evenly(range(6), 4)] == [2, 2, 1, 1]
    assert split_evenly(range(2), 5) == [[0], [1]]
    a, b, c = object(), object(), object()
    assert group_positions([[c, a], [object()]], [a, b, c]) == [[2, 0], []]
    with pytest.raises(ValueError, match="more than one group"):
        group_positions([[a], [a]], [a, b])
    assert partition([0, 1, 2], [[2, 0], []]) == [[2, 0], [1]]
    assert partition([0, 2, 3], 2) == [[0, 2], [3]]


def test_order_as_reference_refuses_different_parameters():
    assert order_as_reference(["b", "c", "a"], ["a", "b", "c"]) == [2, 0, 1]
    with pytest.raises(ValueError, match="differ"):
        order_as_reference(["a", "x"], ["a", "b"])


def test_compression_must_be_a_compressor():
    from hora.compression import Compression

    assert check_compression(Compression.fp16) is Compression.fp16
    with pytest.raises(TypeError, match="compressor"):
        check_compression("fp16")


# ---- HORA_COMPRESSION: the compression of a wrapper left at Compression.none ------------------------

def test_hora_compression_applies_only_to_a_wrapper_left_at_compression_none(caplog):
    from hora.compression import Compression

    env = {"HORA_COMPRESSION": "fp16"}
    with caplog.at_level("INFO", logger="hora"):
        assert check_compression(Compression.none, environ=env) is Compression.fp16
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("hora") and r.levelname == "INFO"]
    assert len(lines) == 1 and "HORA_COMPRESSION=fp16" in lines[0] and "Compression.fp16" in lines[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="hora"):  # an explicit compression argument wins, silently
        assert check_compression(Compression.bf16, environ=env) is Compression.bf16
        assert check_compression(Compression.fp16, environ={"HORA_COMPRESSION": "bf16"}) is Compression.fp16
        # unset, or none: the default stays, with nothing logged
        assert check_compression(Compression.none, environ={}) is Compression.none
        assert check_compression(Compression.none, environ={"HORA_COMPRESSION": "none"}) is Compression.none
    assert not [r for r in caplog.records if r.name.startswith("hora")]
    assert check_compression(Compression.none, environ={"HORA_COMPRESSION": "bf16"}) is Compression.bf16


def test_hora_compression_powersgd_reaches_a_stateful_wrapper():
    from hora.compression import Compression

    env = {"HORA_COMPRESSION": "powersgd:4:100"}
    assert check_compression(Compression.none, stateful=True, environ=env) == Compression.powersgd(
        rank=4, start_iter=100)
    spec = Compression.powersgd(rank=2)  # an explicit spec wins over the variable
    assert check_compression(spec, stateful=True, environ=env) is spec


def test_tf_keras_jax_wrappers_refuse_hora_compression_powersgd_naming_the_variable():
    """hora.tensorflow/hora.keras/hora.jax build with check_compression(..., stateful=False)."""
    from hora.compression import Compression
    from hora.errors import UnsupportedOperationError

    with pytest.raises(UnsupportedOperationError) as info:
        check_compression(Compression.none, environ={"HORA_COMPRESSION": "powersgd:4"})
    message = str(info.value)
    assert "\n" not in message
    assert "cannot run in this gradient wrapper" in message  # the spec's own reason...
    assert "HORA_COMPRESSION=powersgd:4" in message and "hora run --compression" in message  # ...and where from
    # an explicit argument in the script is refused with the reason alone
    with pytest.raises(UnsupportedOperationError) as info:
        check_compression(Compression.powersgd(), environ={})
    assert "HORA_COMPRESSION" not in str(info.value)


def test_bad_hora_compression_is_a_config_error_naming_the_variable_when_a_wrapper_is_built():
    from hora.compression import Compression
    from hora.errors import ConfigError

    with pytest.raises(ConfigError, match=r"HORA_COMPRESSION='powersgd:0' is invalid: expected none, fp16, bf16, "
                       r"powersgd\[:RANK\[:START_ITER\]\] or topk\[:RATIO\]"):
        check_compression(Compression.none, environ={"HORA_COMPRESSION": "powersgd:0"})
    # an explicit argument never reads the variable
    assert check_compression(Compression.fp16, environ={"HORA_COMPRESSION": "zip"}) is Compression.fp16


def test_plain_collectives_never_call_check_compression():
    """So HORA_COMPRESSION never changes a plain hvd.allreduce: only gradient wrappers call it."""
    from pathlib import Path

    src = Path(hora.__file__).resolve().parent
    collective_modules = [p for p in src.rglob("*.py")
                          if p.name in ("mpi_ops.py", "functions.py", "tensors.py", "collectives.py",
                                        "common_api.py", "batched.py", "gradient_buckets.py")]
    assert len(collective_modules) >= 5
    callers = [str(p.relative_to(src)) for p in collective_modules if "check_compression" in p.read_text()]
    assert callers == []
