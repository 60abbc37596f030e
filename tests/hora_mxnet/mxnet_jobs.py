"""The MXNet test jobs: each function returns its named sections (tests/sections.py) and runs on
every rank inside the MXNet venv (started by mxnet_driver.py). Results are NumPy/Python values."""

from __future__ import annotations

import warnings

import numpy as np
from mxnet_cases import DTYPES, SHAPES, gathered_rows, ops_for, value


def _error(call) -> str | None:
    """The error ``call`` raises, as 'Type: message', or None."""
    try:
        call()
    except Exception as exc:  # the message is what the tests check
        return f"{type(exc).__name__}: {exc}"
    return None


def _error_bases(call) -> list[str] | None:
    """The built-in exception types the error ``call`` raises is an instance of (Horovod's types)."""
    try:
        call()
    except Exception as exc:  # the types are what the tests check
        return sorted(c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins")
    return None


def collectives() -> list:
    import mxnet as mx

    import hora.mxnet as hvd

    r, n = hvd.rank(), hvd.size()

    def nd(a):
        return mx.nd.array(a, dtype=a.dtype)

    def allreduce():
        out = {}
        for dtype in DTYPES:
            for shape in SHAPES:
                x = nd(value(dtype, shape, r))
                for op in ops_for(dtype):
                    o = getattr(hvd, op)
                    inplace = x.copy()
                    hvd.allreduce_(inplace, op=o, name=f"ar_.{dtype}.{shape}.{op}")
                    handle = hvd.allreduce_async(x, op=o, name=f"ar_async.{dtype}.{shape}.{op}")
                    grouped = hvd.grouped_allreduce([x, x], op=o, name=f"gar.{dtype}.{shape}.{op}")
                    out[dtype, shape, op] = {
                        "plain": hvd.allreduce(x, op=o, name=f"ar.{dtype}.{shape}.{op}").asnumpy(),
                        "inplace": inplace.asnumpy(), "async": hvd.synchronize(handle).asnumpy(),
                        "grouped": [g.asnumpy() for g in grouped], "input_after": x.asnumpy(),
                        "dtype": str(np.dtype(hvd.allreduce(x, op=o).dtype)),
                    }
        return out

    def others():
        out = {}
        for dtype in DTYPES:
            for shape in SHAPES:
                rows = value(dtype, (gathered_rows(r),) + shape[1:], r)
                x = nd(value(dtype, shape, r))
                bcast_inplace = x.copy()
                hvd.broadcast_(bcast_inplace, root_rank=n - 1)
                splits = [1] * (n - 1) + [shape[0] - (n - 1)] if shape[0] >= n else None
                a2a = hvd.alltoall(x, splits=splits) if splits else None
                out[dtype, shape] = {
                    "allgather": hvd.allgather(nd(rows)).asnumpy(),
                    "grouped_allgather": [g.asnumpy() for g in hvd.grouped_allgather([nd(rows), x])],
                    "broadcast": hvd.broadcast(x, root_rank=n - 1).asnumpy(),
                    "broadcast_": bcast_inplace.asnumpy(),
                    "alltoall": (a2a[0].asnumpy(), a2a[1].asnumpy()) if a2a else None,
                }
                if dtype != "bool":
                    out[dtype, shape]["reducescatter"] = {
                        op: hvd.reducescatter(x, op=getattr(hvd, op)).asnumpy() for op in ("Sum", "Average")}
                    out[dtype, shape]["grouped_reducescatter"] = [
                        g.asnumpy() for g in hvd.grouped_reducescatter([x, x], op=hvd.Sum)]
        return out

    def arguments():
        x = mx.nd.array([1.0, 2.0]) * (r + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prio = hvd.allreduce(x, priority=5, name="prio").asnumpy()
        return {
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25).asnumpy(),
            "average_false": hvd.allreduce(x, average=False).asnumpy(),
            "average_true": hvd.allreduce(x, average=True).asnumpy(),
            "default": hvd.allreduce(x).asnumpy(),
            "priority": prio, "priority_warned": any("priority" in str(w.message) for w in caught),
            "empty_grouped": hvd.grouped_allreduce([]),
            "alltoall_equal": hvd.alltoall(mx.nd.arange(2 * n) + 10 * r).asnumpy(),
            "objects": (hvd.broadcast_object({"from": r}, root_rank=n - 1), hvd.allgather_object(r * 10)),
            "poll": _poll(hvd, x),
            "context": str(hvd.allreduce(x).context),
            "errors": {
                "average_and_op": _error(lambda: hvd.allreduce(x, average=True, op=hvd.Sum)),
                "bool_average": _error(lambda: hvd.allreduce(mx.nd.array([1, 0], dtype="bool"))),
                "not_ndarray": _error(lambda: hvd.allreduce(np.ones(2))),
                "bad_root": _error(lambda: hvd.broadcast(x, root_rank=n + 3)),
                "reducescatter_max": _error(lambda: hvd.reducescatter(x, op=hvd.Max)),
                "reducescatter_max_bases": _error_bases(lambda: hvd.reducescatter(x, op=hvd.Max)),
            },
        }

    def bad_input():
        dense = mx.nd.ones((3, 2))
        out = {
            "row_sparse": _error(lambda: hvd.allreduce(dense.tostype("row_sparse"))),
            "csr": _error(lambda: hvd.allgather(dense.tostype("csr"), name="csr")),
            "sparse_in_group": _error(lambda: hvd.grouped_allreduce([dense, dense.tostype("row_sparse")])),
            "sparse_broadcast_": _error(lambda: hvd.broadcast_(dense.tostype("row_sparse"), 0)),
            "after_sparse": hvd.allreduce(dense, op=hvd.Sum, name="after_sparse").asnumpy(),
            "bf16": _error(lambda: hvd.Compression.bf16.compress(dense)),
            "mismatch": _error(lambda: hvd.allreduce(mx.nd.ones((2 + r,)), name="mismatch")),
            "mismatch_dtype": _error(lambda: hvd.allreduce(mx.nd.ones(2, dtype="float32" if r else "float64"),
                                                           name="mismatch_dtype")),
        }
        out["after_mismatch"] = hvd.allreduce(mx.nd.ones(2), op=hvd.Sum, name="after_mismatch").asnumpy()
        out.update(_compression_from_environment(hvd, mx))
        return out

    return [("allreduce", allreduce), ("others", others), ("arguments", arguments), ("bad_input", bad_input)]


def _compression_from_environment(hvd, mx) -> dict:
    """HORA_COMPRESSION (hora run --compression) reaches MXNet's wrappers as it reaches the others:
    fp16 is taken by both, PowerSGD (which MXNet cannot run) is refused when the trainer is built."""
    import os

    from mxnet import gluon

    out = {}
    params = gluon.nn.Dense(2, in_units=3).collect_params()
    params.initialize()
    for choice in ("fp16", "powersgd:4"):
        os.environ["HORA_COMPRESSION"] = choice
        try:
            optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1))
            out[f"optimizer_{choice}"] = optimizer._compression.__name__
        except Exception as exc:
            out[f"optimizer_{choice}"] = f"{type(exc).__name__}: {exc}"
        try:
            trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.1})
            out[f"trainer_{choice}"] = trainer._compression.__name__
        except Exception as exc:
            out[f"trainer_{choice}"] = f"{type(exc).__name__}: {exc}"
        finally:
            del os.environ["HORA_COMPRESSION"]
    return out


def _poll(hvd, x) -> bool:
    handle = hvd.allreduce_async_(x.copy(), name="polled")
    while not hvd.poll(handle):
        pass
    return bool(hvd.poll(handle)) and hvd.synchronize(handle).shape == x.shape


# ---- training -----------------------------------------------------------------------------------

STEPS, BATCH, FEATURES, CLASSES = 20, 16, 10, 3


def _data():
    rng = np.random.RandomState(7)
    x = rng.randn(STEPS, BATCH, FEATURES).astype(np.float32)
    y = rng.randint(0, CLASSES, size=(STEPS, BATCH)).astype(np.float32)
    return x, y


def _net(mx, seed: int):
    from mxnet import gluon

    mx.random.seed(seed)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(8, activation="tanh", in_units=FEATURES), gluon.nn.Dense(CLASSES, in_units=8))
    net.initialize(mx.init.Xavier())
    return net


def _weights(net) -> list[np.ndarray]:
    return [p.data().asnumpy() for p in net.collect_params().values()]


def _copy_weights(src, dst) -> None:
    for a, b in zip(src.collect_params().values(), dst.collect_params().values()):
        b.set_data(a.data())


def training() -> list:
    import mxnet as mx
    from mxnet import autograd, gluon

    import hora.mxnet as hvd

    r, n = hvd.rank(), hvd.size()
    xs, ys = _data()
    shard = slice(r * BATCH // n, (r + 1) * BATCH // n)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def optimizer(kind):
        if kind == "sgd":
            return mx.optimizer.SGD(learning_rate=0.1, momentum=0.9)
        return mx.optimizer.Adam(learning_rate=0.01)

    def train(net, trainer, part, batch_size):
        for step in range(STEPS):
            with autograd.record():
                loss = loss_fn(net(mx.nd.array(xs[step][part])), mx.nd.array(ys[step][part]))
            loss.backward()
            trainer.step(batch_size)
        return _weights(net)

    def compare(kind, how, **kwargs):
        net = _net(mx, seed=100 + r)  # different on every rank: broadcast_parameters must equalise them
        hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=f"{kind}.{how}.")
        start = _weights(net)
        reference = _net(mx, seed=0)
        _copy_weights(net, reference)
        expected = train(reference, gluon.Trainer(reference.collect_params(), optimizer(kind), kvstore=None),
                         slice(None), BATCH)
        if how == "trainer":
            trainer = hvd.DistributedTrainer(net.collect_params(), optimizer(kind), prefix=f"{kind}.", **kwargs)
        else:
            trainer = gluon.Trainer(net.collect_params(), hvd.DistributedOptimizer(optimizer(kind), **kwargs),
                                    kvstore=None)
        got = train(net, trainer, shard, BATCH // n)
        return {"start": start, "expected": expected, "got": got}

    def deferred():
        from mxnet import gluon as g

        mx.random.seed(200 + r)
        net = g.nn.Dense(4)  # in_units unknown: initialisation waits for the first forward pass
        net.initialize()
        hvd.broadcast_parameters(net.collect_params(), root_rank=1 % n, prefix="deferred.")
        net(mx.nd.ones((1, 3)))
        return _weights(net)

    def sparse_gradient():
        from mxnet import gluon as g

        emb = g.nn.Embedding(10, 4, sparse_grad=True)
        emb.initialize()
        trainer = hvd.DistributedTrainer(emb.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="sparse.")
        with autograd.record():
            loss = emb(mx.nd.array([1, 2])).sum()
        loss.backward()
        error = _error(lambda: trainer.step(2))
        after = hvd.allreduce(mx.nd.ones(3), op=hvd.Sum, name="after_sparse_grad").asnumpy()
        return {"error": error, "after": after}

    def wrapping():
        net = _net(mx, seed=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvd.DistributedTrainer(net.collect_params(), hvd.DistributedOptimizer(optimizer("sgd")))
        return {
            "unwrapped_warning": any("unwrapped" in str(w.message) for w in caught),
            "bad_factor": _error(lambda: hvd.DistributedTrainer(net.collect_params(), "sgd",
                                                                gradient_predivide_factor=0.0)),
            "bad_params": _error(lambda: hvd.broadcast_parameters([1, 2])),
            "is_optimizer": isinstance(hvd.DistributedOptimizer(optimizer("sgd")), mx.optimizer.Optimizer),
        }

    return [
        ("sgd_trainer", lambda: compare("sgd", "trainer")),
        ("adam_trainer", lambda: compare("adam", "trainer")),
        ("sgd_optimizer", lambda: compare("sgd", "optimizer")),
        ("adam_optimizer", lambda: compare("adam", "optimizer")),
        ("sgd_trainer_predivide_groups", lambda: compare("sgd", "trainer", gradient_predivide_factor=2.0,
                                                         num_groups=2)),
        ("adam_optimizer_predivide_groups", lambda: compare("adam", "optimizer", gradient_predivide_factor=2.0,
                                                            num_groups=2)),
        ("sgd_trainer_fp16", lambda: compare("sgd", "trainer", compression=hvd.Compression.fp16)),
        ("deferred", deferred),
        ("sparse_gradient", sparse_gradient),
        ("wrapping", wrapping),
    ]
