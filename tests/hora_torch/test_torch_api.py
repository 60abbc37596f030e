"""hora.torch offers horovod.torch's public names with Horovod 0.28's exact signatures.

The expected signatures below are data, written as Horovod 0.28 spells them out; every one was
checked against the horovod-0.28.1 source distribution (horovod/torch/*.py,
horovod/common/basics.py, process_sets.py). Each is compared with ``inspect.signature``: parameter
names, order, kinds and defaults. hora may add parameters only at the end, each with a default
(EXTRA_ALLOWED lists them), so that every Horovod call, positional or keyword, still means the same.
No job is started here: nothing needs init().
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from signature_check import EVERY_BINDING, REDUCE_OPS, check, parse  # noqa: E402

import hora.torch as hvd  # noqa: E402

pytestmark = pytest.mark.timeout(60)

# ---- hora.torch ---------------------------------------------------------------------------------

TORCH = [
    "allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,"
    " prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)",
    "allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,"
    " process_set=global_process_set)",
    "allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,"
    " process_set=global_process_set)",
    "allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,"
    " process_set=global_process_set)",
    "grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,"
    " prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)",
    "grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,"
    " postscale_factor=1.0, process_set=global_process_set)",
    "grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,"
    " process_set=global_process_set)",
    "grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,"
    " postscale_factor=1.0, process_set=global_process_set)",
    "allgather(tensor, name=None, process_set=global_process_set)",
    "allgather_async(tensor, name=None, process_set=global_process_set)",
    "grouped_allgather(tensors, name=None, process_set=global_process_set)",
    "grouped_allgather_async(tensors, name=None, process_set=global_process_set)",
    "broadcast(tensor, root_rank, name=None, process_set=global_process_set)",
    "broadcast_async(tensor, root_rank, name=None, process_set=global_process_set)",
    "broadcast_(tensor, root_rank, name=None, process_set=global_process_set)",
    "broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set)",
    "alltoall(tensor, splits=None, name=None, process_set=global_process_set)",
    "alltoall_async(tensor, splits=None, name=None, process_set=global_process_set)",
    "reducescatter(tensor, name=None, compression=Compression.none, op=Average,"
    " process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0)",
    "reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,"
    " prescale_factor=1.0, postscale_factor=1.0)",
    "grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,"
    " process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0)",
    "grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,"
    " prescale_factor=1.0, postscale_factor=1.0)",
    "sparse_allreduce_async(tensor, name, op, process_set=global_process_set)",
    "barrier(process_set=global_process_set)",
    "join(device=-1)",
    "poll(handle)",
    "synchronize(handle)",
    "broadcast_parameters(params, root_rank)",
    "broadcast_optimizer_state(optimizer, root_rank, model=None)",
    "broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set)",
    "allgather_object(obj, name=None)",
    "DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,"
    " backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,"
    " sparse_as_dense=False, process_set=global_process_set)",
]

# Classes: the signature of the constructor (without self).
CLASSES = [
    "ProcessSet(ranks_or_comm)",
    "SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True)",
]

COMPRESSORS = [
    "compress(tensor)",
    "decompress(tensor, ctx)",
]

# hora's additions: trailing parameters with defaults only.
EXTRA_ALLOWED = {
    # Horovod 0.28's allgather_object has no process_set; hora's takes one, like broadcast_object.
    "allgather_object": {"process_set"},
    # a process set to synchronise the statistics over (the global set by default)
    "SyncBatchNorm": {"process_set"},
    # ZeRO stages 1 and 2 behind Horovod's optimizer, and comm hooks (keyword-only; docs/memory.md)
    "DistributedOptimizer": {"shard_optimizer_state", "shard_gradients", "comm_hook"},
    # caller-named blocks (sharded gradients) and a buffer given up to the engine (keyword-only)
    "reducescatter": {"blocks", "donate"},
    "reducescatter_async": {"blocks", "donate"},
}



def _parse(spec: str) -> tuple[str, list[tuple[str, object]]]:
    """``name(a, b=1)`` -> ("name", [("a", EMPTY), ("b", 1)]); defaults evaluated in hora.torch."""
    return parse(spec, vars(hvd))


def _check(name: str, actual: inspect.Signature, expected: list[tuple[str, object]]) -> None:
    check(name, actual, expected, EXTRA_ALLOWED.get(name, set()))


@pytest.mark.parametrize("spec", EVERY_BINDING + TORCH, ids=lambda s: s.split("(")[0])
def test_function_signature_matches_horovod(spec):
    name, expected = _parse(spec)
    assert hasattr(hvd, name), f"hora.torch lacks {name}"
    fn = getattr(hvd, name)
    assert callable(fn)
    _check(name, inspect.signature(fn), expected)


@pytest.mark.parametrize("spec", CLASSES, ids=lambda s: s.split("(")[0])
def test_class_constructor_signature_matches_horovod(spec):
    name, expected = _parse(spec)
    cls = getattr(hvd, name)
    assert isinstance(cls, type)
    _check(name, inspect.signature(cls), expected)


@pytest.mark.parametrize("compressor", ["none", "fp16"])
@pytest.mark.parametrize("spec", COMPRESSORS, ids=lambda s: s.split("(")[0])
def test_compressor_signatures(compressor, spec):
    name, expected = _parse(spec)
    method = getattr(getattr(hvd.Compression, compressor), name)
    _check(f"Compression.{compressor}.{name}", inspect.signature(method), expected)


def test_reduce_op_constants_have_horovods_values():
    for name, value in REDUCE_OPS.items():
        assert getattr(hvd, name) == value, name


def test_errors_process_sets_and_sync_batch_norm_types():
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(hvd.HostsUpdatedInterrupt, BaseException)
    assert isinstance(hvd.global_process_set, hvd.ProcessSet) and hvd.global_process_set.process_set_id == 0
    assert issubclass(hvd.SyncBatchNorm, torch.nn.modules.batchnorm._BatchNorm)
    ps = hvd.ProcessSet([2, 0])
    assert ps.ranks == [0, 2] and ps.process_set_id is None


def test_optimizer_methods_exist():
    # DistributedOptimizer needs init(); its methods come from the mixin it builds classes from.
    from hora.torch.optimizer import _DistributedOptimizer

    for method in ("step", "synchronize", "skip_synchronize", "zero_grad", "set_backward_passes_per_step"):
        assert callable(getattr(_DistributedOptimizer, method)), method
    assert list(inspect.signature(_DistributedOptimizer.step).parameters) == ["self", "closure"]
    assert inspect.signature(_DistributedOptimizer.step).parameters["closure"].default is None


def test_build_queries_tell_the_truth_without_init():
    # MPI is built when mpi4py loads its MPI library (enabled only in a world formed over it); NCCL
    # reports the loadable library's version (0 without one); no Gloo, CCL, DDL or ROCm collectives.
    from hora.transport.mpi import unavailable_reason

    assert hvd.mpi_built() is (unavailable_reason() is None) and hvd.mpi_enabled() is False
    assert hvd.gloo_built() is False and hvd.gloo_enabled() is False
    assert isinstance(hvd.nccl_built(), int)
    if hvd.nccl_built() == 0:
        assert not hvd.cuda_built()  # CUDA collectives need NCCL
    assert not hvd.ccl_built() and not hvd.ddl_built() and not hvd.rocm_built()
    with pytest.raises(ValueError):
        hvd.mpi_threads_supported()


def test_topology_before_init_raises_value_error(uninitialised):
    for query in (hvd.size, hvd.rank, hvd.local_size, hvd.local_rank, hvd.cross_size, hvd.cross_rank):
        with pytest.raises(ValueError, match="init"):
            query()


def test_elastic_names_exist():
    import hora.elastic
    import hora.torch.elastic as elastic

    assert elastic.run is hora.elastic.run
    assert issubclass(elastic.TorchState, hora.elastic.ObjectState)
    assert issubclass(elastic.ElasticSampler, torch.utils.data.Sampler)
    # Horovod's signatures: run(func), TorchState(model=None, optimizer=None, **kwargs),
    # ElasticSampler(dataset, shuffle=True, seed=0).
    assert list(inspect.signature(elastic.run).parameters) == ["func"]
    state = inspect.signature(elastic.TorchState).parameters
    assert list(state) == ["model", "optimizer", "kwargs"]
    assert state["model"].default is None and state["optimizer"].default is None
    assert state["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    name, expected = parse("ElasticSampler(dataset, shuffle=True, seed=0)", {})
    check(name, inspect.signature(elastic.ElasticSampler), expected)
    for method in ("set_epoch", "record_batch", "record_indices", "get_indices", "state_dict",
                   "load_state_dict", "reset"):
        assert callable(getattr(elastic.ElasticSampler, method)), method
    for method in ("commit", "save", "restore", "sync", "check_host_updates", "register_reset_callbacks",
                   "on_reset"):
        assert callable(getattr(elastic.TorchState, method)), method
