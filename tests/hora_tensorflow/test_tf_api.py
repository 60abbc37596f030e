"""hora.tensorflow and hora.keras offer Horovod 0.28's public names with its exact signatures.

The expected signatures are data, written from horovod-0.28.1's horovod/tensorflow/__init__.py,
mpi_ops.py, functions.py, keras/__init__.py and keras/callbacks.py, and compared with
``inspect.signature`` (parameter names, order, kinds, defaults; hora may add trailing parameters with
defaults, listed in EXTRA_ALLOWED). Also: the lifecycle names are hora's own objects in every
binding, ``hora.tensorflow.keras`` is ``hora.keras`` under Horovod's spelling, and importing one
framework's binding never imports another framework (hora.torch in a fresh interpreter; hora.tensorflow
in the workers of the 3-rank TensorFlow job this module joins, as its only job; hora.keras on the torch
backend in test_keras_torch_backend.py's workers).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

from signature_check import EVERY_BINDING, REDUCE_OPS, check, parse
from tf_job import shared_job

import hora
import hora.keras as hk
import hora.tensorflow as htf

pytestmark = pytest.mark.timeout(120)

TENSORFLOW = [
    "allreduce(tensor, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None,"
    " prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,"
    " ignore_name_scope=False)",
    "grouped_allreduce(tensors, average=None, device_dense='', device_sparse='', compression=Compression.none,"
    " op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,"
    " ignore_name_scope=False)",
    "allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set)",
    "grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set)",
    "broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set)",
    "broadcast_(variables, root_rank, name=None, process_set=global_process_set)",
    "alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set)",
    "reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,"
    " process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0)",
    "grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,"
    " process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0)",
    "barrier(process_set=global_process_set)",
    "join()",
    "size_op(process_set_id=0, name=None)",
    "local_size_op(name=None)",
    "rank_op(name=None)",
    "local_rank_op(name=None)",
    "process_set_included_op(process_set_id=0, name=None)",
    "broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False)",
    "broadcast_global_variables(root_rank)",
    "broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set)",
    "broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set)",
    "allgather_object(obj, session=None, name=None, process_set=global_process_set)",
    "DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,"
    " sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,"
    " process_set=global_process_set, scale_local_gradients=True)",
    "DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='',"
    " compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1, op=Average,"
    " gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0, groups=None,"
    " process_set=global_process_set, scale_local_gradients=True)",
    "PartialDistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,"
    " sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,"
    " process_set=global_process_set, local_layers=None, scale_local_gradients=True)",
    "BroadcastGlobalVariablesHook(root_rank, device='')",
]

KERAS = [
    "DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,"
    " sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,"
    " average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set,"
    " scale_local_gradients=True)",
    "broadcast_global_variables(root_rank)",
    "allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,"
    " compression=Compression.none)",
    "allgather(value, name=None)",
    "broadcast(value, root_rank, name=None)",
    "reducescatter(value, name=None, op=Average)",
    "load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,"
    " legacy_opts=False)",
]

CALLBACKS = [
    "BroadcastGlobalVariablesCallback(root_rank, device='', local_variables=None)",
    "MetricAverageCallback(device='')",
    "LearningRateScheduleCallback(initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,"
    " momentum_correction=True, steps_per_epoch=None)",
    "LearningRateWarmupCallback(initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,"
    " verbose=0)",
]

# hora's additions: trailing parameters with defaults only.
EXTRA_ALLOWED = {
    "tensorflow": {
        # the fused unit's name (Horovod derives it from the TF op names)
        "grouped_allreduce": {"name"},
        "grouped_reducescatter": {"name"},
        # keyword-only, refused in one line (sharded state is built for hora.torch and hora.jax)
        "DistributedOptimizer": {"shard_optimizer_state"},
    },
    "keras": {**{name: {"process_set"} for name in ("allreduce", "allgather", "broadcast", "reducescatter")},
              "DistributedOptimizer": {"shard_optimizer_state"}},
}

BINDINGS = {"tensorflow": (htf, EVERY_BINDING + TENSORFLOW), "keras": (hk, EVERY_BINDING + KERAS)}


def _cases():
    for binding, (_, specs) in BINDINGS.items():
        for spec in specs:
            yield pytest.param(binding, spec, id=f"{binding}.{spec.split('(')[0]}")


@pytest.mark.parametrize("binding,spec", list(_cases()))
def test_function_signature_matches_horovod(binding, spec):
    module = BINDINGS[binding][0]
    name, expected = parse(spec, vars(module))
    assert hasattr(module, name), f"hora.{binding} lacks {name}"
    check(name, inspect.signature(getattr(module, name)), expected, EXTRA_ALLOWED[binding].get(name, set()))


@pytest.mark.parametrize("spec", CALLBACKS, ids=lambda s: s.split("(")[0])
def test_callback_signatures_match_horovod(spec):
    name, expected = parse(spec, vars(hk))
    cls = getattr(hk.callbacks, name)
    assert isinstance(cls, type) and issubclass(cls, hk.callbacks.keras.callbacks.Callback)
    check(name, inspect.signature(cls), expected)


@pytest.mark.parametrize("module", [htf, hk], ids=["tensorflow", "keras"])
@pytest.mark.parametrize("compressor", ["none", "fp16"])
def test_compressor_signatures(module, compressor):
    for spec in ("compress(tensor)", "decompress(tensor, ctx)"):
        name, expected = parse(spec, {})
        check(name, inspect.signature(getattr(getattr(module.Compression, compressor), name)), expected)


@pytest.mark.parametrize("module", [htf, hk], ids=["tensorflow", "keras"])
def test_shared_names_are_horas_own_objects(module):
    for name in ("init", "shutdown", "rank", "size", "ProcessSet", "global_process_set", "add_process_set",
                 "HorovodInternalError", "HostsUpdatedInterrupt", "start_timeline"):
        assert getattr(module, name) is getattr(hora, name), name
    for name, value in REDUCE_OPS.items():
        assert getattr(module, name) == value, name
    assert issubclass(module.HorovodInternalError, RuntimeError)
    assert module.Compression is htf.Compression  # one namespace: the same compressors everywhere


def test_horovod_spelling_tensorflow_keras_is_hora_keras():
    import hora.tensorflow.keras as hvd
    import hora.tensorflow.keras.callbacks as callbacks

    for name in hk.__all__:
        if name != "callbacks":  # a module of its own under Horovod's path, holding the same classes
            assert getattr(hvd, name) is getattr(hk, name), name
    assert hvd.callbacks is callbacks
    for name in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
                 "LearningRateWarmupCallback"):
        assert getattr(callbacks, name) is getattr(hk.callbacks, name), name


def test_wrappers_need_init_first(uninitialised):
    import keras
    import tensorflow as tf

    with pytest.raises(ValueError, match="init"):
        htf.DistributedGradientTape(tf.GradientTape())
    with pytest.raises(ValueError, match="init"):
        hk.DistributedOptimizer(keras.optimizers.SGD())
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        hk.DistributedOptimizer(object())


def test_sharded_optimizer_state_is_refused_in_one_line_by_every_tensorflow_wrapper(uninitialised):
    """hora shards optimizer state in hora.torch and hora.jax only: TensorFlow's and Keras's wrappers
    say so, before anything else, rather than taking the flag and keeping the whole state."""
    import keras
    import tensorflow as tf

    for wrap, optimizer in ((hk.DistributedOptimizer, keras.optimizers.Adam()),
                            (htf.DistributedOptimizer, keras.optimizers.Adam()),
                            (htf.DistributedOptimizer, tf.compat.v1.train.AdamOptimizer())):
        with pytest.raises(ValueError, match=r"^shard_optimizer_state=True is not built for TensorFlow and "
                                             r"Keras optimizers.*hora.torch and hora.jax"):
            wrap(optimizer, shard_optimizer_state=True)


def test_groups_with_num_groups_warns_and_groups_wins_in_every_wrapper(uninitialised):
    """Horovod warns (DeprecationWarning, at the caller's line) in every binding and uses ``groups``."""
    import warnings

    import keras
    import tensorflow as tf

    hora.init()
    try:
        wrappers = {
            "tape": lambda: htf.DistributedGradientTape(tf.GradientTape(), num_groups=2, groups=1),
            "keras": lambda: hk.DistributedOptimizer(keras.optimizers.SGD(), num_groups=2, groups=1),
            "tensorflow.keras": lambda: htf.DistributedOptimizer(keras.optimizers.SGD(), num_groups=2, groups=1),
            "tensorflow.v1": lambda: htf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                                               num_groups=2, groups=1),
        }
        for kind, make in wrappers.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wrapped = make()
            about = [w for w in caught if "num_groups" in str(w.message)]
            assert [w.category for w in about] == [DeprecationWarning], kind
            assert about[0].filename == __file__, (kind, about[0].filename)
            reducer = wrapped._hora.reducer if kind.endswith("keras") else wrapped._hora_allreducer
            assert reducer.groups == 1, kind
    finally:
        hora.shutdown()


# ---- framework isolation ---------------------------------------------------------------------------------


def _modules_after(statement: str, env: dict[str, str] | None = None) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m for m in sys.modules if '.' not in m)))"
    environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=environ)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stdout.split())


def _modules_job() -> list:
    """The top-level modules of a TensorFlow job's worker, read when the job calls this function (first
    in its world, by collection order; a later read would only have seen more modules)."""
    import hora.tensorflow.keras  # noqa: F401  (Horovod's spelling, imported as a user would)

    loaded = sorted(m for m in sys.modules if "." not in m)
    return [("modules", lambda: loaded)]


# Read in the 3-rank TensorFlow job's workers (test_tf_graph_mode.py's world, which runs no Keras):
# they have imported hora.tensorflow and hora.tensorflow.keras, and more besides (this module,
# pytest, NumPy), so no torch there means neither import pulls it in; a fresh interpreter for it
# would import TensorFlow once more (seconds of CPU).
MODULES_JOB = shared_job(_modules_job, np=3)


@pytest.mark.timeout(600)  # the first test to ask for the 3-rank job runs all of it (as in test_tf_graph_mode.py)
def test_import_hora_tensorflow_never_imports_torch(request):
    for modules in MODULES_JOB.results(request).all("modules"):
        assert "tensorflow" in modules and "torch" not in modules


def test_import_hora_torch_never_imports_tensorflow():
    pytest.importorskip("torch")
    modules = _modules_after("import hora.torch")
    assert "torch" in modules and "tensorflow" not in modules and "keras" not in modules


def test_hora_check_reports_tensorflow_and_keras_versions(capsys):
    import keras
    import tensorflow as tf

    from hora.cli import main

    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert f"  tensorflow: {tf.__version__}\n" in out  # found under tensorflow-cpu's metadata too
    assert f"  keras: {keras.__version__}\n" in out
    assert "hora.tensorflow" in out and "hora.keras" in out


def test_load_model_refuses_keras2_legacy_optimizers_by_name():
    from hora.keras import load_model

    with pytest.raises(ValueError, match="legacy_opts=True .* Keras 3 removed"):
        load_model("never-read.keras", legacy_opts=True)
