"""hora.torch.DistributedOptimizer on 2 ranks against a 1-worker reference computed in the same job.

The bar: 2 workers that each take half of every batch end with the weights 1 worker gets on the whole
batch (the loss is a mean over the batch, so the average of the two half-batch gradients is the
whole-batch gradient). The reference runs on rank 0 with plain torch, from the same initial weights.
Every section gives its parameters a section-specific name (``named``) so that one section that fails
half-way cannot leave a request in flight under a name the next section uses.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sections import JobResults, SharedJob  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the first test runs every module's share of the job

STEPS = 20
BATCH = 16  # global batch; each of the 2 ranks takes 8 rows
TOL = dict(rtol=1e-5, atol=1e-5)


def data(step: int, rows: int = BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 2, generator=g)


def make_model(seed: int = 1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def named(model, prefix: str):
    return [(f"{prefix}.{name}", p) for name, p in model.named_parameters()]


def weights(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def conv_model(seed: int = 7):
    """14 tensors of conv, batch-norm and linear layers; the second conv's weight is channels_last, and
    at a 600-byte bucket cap (``VIEW_CAP``) they make 4 buckets, one holding that weight, and a lone tensor."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Conv2d(4, 2, 1), torch.nn.Flatten(), torch.nn.Linear(32, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model[3].to(memory_format=torch.channels_last)
    return model


VIEW_CAP = 600


def conv_data(step: int, r: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(50 + 10 * step + r)
    return torch.randn(4, 3, 4, 4, generator=g).to(dtype), torch.randn(4, 2, generator=g).to(dtype)


def rank_shard(step: int, r: int, n: int):
    """Rank ``r``'s share (1/n of the rows) of step ``step``'s global batch."""
    x, y = data(step)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
    return x[rows], y[rows]


def reference_train(make_opt, steps: int = STEPS, before_step=None, scheduler=None):
    """1 worker, whole batch: the weights the distributed runs must reach."""
    model = make_model()
    opt = make_opt(model.parameters())
    sched = scheduler(opt) if scheduler else None
    for s in range(steps):
        x, y = data(s)
        opt.zero_grad()
        mse(model, x, y).backward()
        if before_step:
            before_step(model)
        opt.step()
        if sched:
            sched.step()
    return weights(model)


# ---- the job ----------------------------------------------------------------------------------


def _job() -> list:
    import copy
    import warnings

    import hora.torch as hvd

    r, n = hvd.rank(), hvd.size()

    def shard(step):
        return rank_shard(step, r, n)

    def train(opt, model, steps=STEPS, sched=None):
        for s in range(steps):
            x, y = shard(s)
            opt.zero_grad()
            mse(model, x, y).backward()
            opt.step()
            if sched:
                sched.step()
        return weights(model)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def adam(params):
        return torch.optim.Adam(params, lr=0.01)

    def with_reference(make_opt, dist_weights, **ref_kwargs):
        out = {"weights": dist_weights}
        if r == 0:
            out["reference"] = reference_train(make_opt, **ref_kwargs)
        return out

    def equivalence(make_opt, prefix, **kwargs):
        def section():
            model = make_model()
            opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=named(model, prefix),
                                           **kwargs)
            return with_reference(make_opt, train(opt, model))
        return section

    # (b) backward_passes_per_step=k: Horovod sums the gradients of the k local passes, then
    # averages across ranks. So each micro-batch loss is scaled by 1/k: the k scaled gradients add
    # up to the gradient of this rank's mean loss, and the average over ranks is the gradient of the
    # whole batch's mean loss, as 1 worker computes it on k times larger batches.
    def accumulate(k, use_setter):
        def section():
            model = make_model()
            if use_setter:
                opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, f"bpps.set{k}"))
                opt.set_backward_passes_per_step(k)
            else:
                opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, f"bpps{k}"),
                                               backward_passes_per_step=k)
            micro = BATCH // (n * k)
            for s in range(10):
                x, y = data(s)
                opt.zero_grad()
                for i in range(k):
                    rows = slice((r * k + i) * micro, (r * k + i + 1) * micro)
                    (mse(model, x[rows], y[rows]) / k).backward()
                opt.step()
            return with_reference(sgd, weights(model), steps=10)
        return section

    def fp16_gradients():
        # one step: the averaged gradients equal the exact whole-batch gradient within fp16 precision
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "fp16.grad"),
                                       compression=hvd.Compression.fp16)
        x, y = shard(0)
        mse(model, x, y).backward()
        opt.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        ref = make_model()
        mse(ref, *data(0)).backward()
        return {"grads": grads, "dtypes": [g.dtype for g in grads], "reference": [p.grad for p in ref.parameters()]}

    def hook_order_two_losses():
        # Six independent layers, one loss each; rank 0 calls backward on them in order, rank 1 in
        # reverse, so gradient hooks (and the allreduces they start) fire in opposite orders.
        torch.manual_seed(3)
        layers = torch.nn.ModuleList(torch.nn.Linear(3, 1) for _ in range(6))
        ref = copy.deepcopy(layers)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.1),
                                       named_parameters=named(layers, "order.losses"))
        fired = []
        for i, layer in enumerate(layers):
            layer.weight.register_post_accumulate_grad_hook(lambda p, i=i: fired.append(i))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            xs, ys = torch.randn(n, 4, 3, generator=g), torch.randn(n, 4, 1, generator=g)
            opt.zero_grad()
            order = range(6) if r == 0 else reversed(range(6))
            for i in order:
                mse(layers[i], xs[r], ys[r]).backward()
            opt.step()
            # reference: the average over ranks of each rank's loss
            ref_opt.zero_grad()
            sum(mse(ref[i], xs[k], ys[k]) for i in range(6) for k in range(n)).div(n).backward()
            ref_opt.step()
        return {"fired": fired[:6], "weights": weights(layers), "reference": weights(ref)}

    def hook_order_one_backward():
        # Rank 0 computes b(a(x)), rank 1 a(b(x)): in one backward pass their hooks fire in opposite
        # orders (the layer nearest the loss first).
        torch.manual_seed(4)
        a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        model = torch.nn.ModuleDict({"a": a, "b": b})
        ref = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                       named_parameters=named(model, "order.one"))
        fired = []
        a.weight.register_post_accumulate_grad_hook(lambda p: fired.append("a"))
        b.weight.register_post_accumulate_grad_hook(lambda p: fired.append("b"))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)

        def loss(m, k, x, y):
            out = m["b"](m["a"](x)) if k == 0 else m["a"](m["b"](x))
            return torch.nn.functional.mse_loss(out, y)

        for s in range(3):
            g = torch.Generator().manual_seed(10 + s)
            xs, ys = torch.randn(n, 4, 3, generator=g), torch.randn(n, 4, 3, generator=g)
            opt.zero_grad()
            loss(model, r, xs[r], ys[r]).backward()
            opt.step()
            ref_opt.zero_grad()
            sum(loss(ref, k, xs[k], ys[k]) for k in range(n)).div(n).backward()
            ref_opt.step()
        return {"fired": fired[:2], "weights": weights(model), "reference": weights(ref)}

    def missing_gradients():
        # "used" gets gradients everywhere, "rank0" only on rank 0, "never" on no rank.
        torch.manual_seed(5)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "rank0": torch.nn.Linear(3, 1),
                                     "never": torch.nn.Linear(3, 1)})
        ref = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=named(model, "missing"))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

        def loss(m, k, x):
            out = m["used"](x) + (m["rank0"](x) if k == 0 else 0)
            return (out ** 2).mean()

        for s in range(3):
            xs = torch.randn(n, 4, 3, generator=torch.Generator().manual_seed(20 + s))
            opt.zero_grad()
            loss(model, r, xs[r]).backward()
            opt.step()
            ref_opt.zero_grad()
            sum(loss(ref, k, xs[k]) for k in range(n)).div(n).backward()
            ref_opt.step()
        return {"weights": weights(model), "reference": weights(ref),
                "never_initial": weights(ref["never"])}

    def groups_variant(kind):
        def section():
            model = make_model()
            params = list(model.parameters())
            kwargs = {"int": {"groups": 2}, "list": {"groups": [[params[0], params[3]], [params[1], params[2]]]},
                      "num_groups": {"num_groups": 3}, "one_group": {"groups": [params]},
                      "predivide": {"gradient_predivide_factor": 2.0}}[kind]
            opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, f"groups.{kind}"),
                                           **kwargs)
            return with_reference(sgd, train(opt, model, steps=5), steps=5)
        return section

    def op_sum():
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "opsum"), op=hvd.Sum)
        x, y = shard(0)
        mse(model, x, y).backward()
        opt.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        ref = make_model()
        mse(ref, *data(0)).backward()  # whole-batch mean: the summed gradient is n times this
        return {"grads": grads, "reference": [p.grad * n for p in ref.parameters()]}

    def sparse(sparse_as_dense, kind):
        def section():
            # rank 0 looks up rows 0, 1, 2, 2 and rank 1 rows 2, 3, 4, 9: row 2 is shared.
            idx = torch.tensor([[0, 1, 2, 2], [2, 3, 4, 9]])
            target = torch.randn(n, 4, 3, generator=torch.Generator().manual_seed(30))
            torch.manual_seed(6)
            emb = torch.nn.Embedding(10, 3, sparse=True)
            ref = torch.nn.Embedding(10, 3, sparse=True)
            ref.load_state_dict(emb.state_dict())

            def make(params):
                return torch.optim.SGD(params, lr=0.5) if kind == "sgd" else torch.optim.SparseAdam(params, lr=0.1)

            opt = hvd.DistributedOptimizer(make(emb.parameters()),
                                           named_parameters=named(emb, f"sparse.{sparse_as_dense}.{kind}"),
                                           sparse_as_dense=sparse_as_dense)
            ref_opt = make(ref.parameters())
            grad_sparse = []
            for _ in range(5):
                opt.zero_grad()
                ((emb(idx[r]) - target[r]) ** 2).mean().backward()
                opt.synchronize()
                grad_sparse.append(emb.weight.grad.is_sparse)
                with opt.skip_synchronize():
                    opt.step()
                ref_opt.zero_grad()
                ((ref(idx.reshape(-1)) - target.reshape(-1, 3)) ** 2).mean().backward()
                ref_opt.step()
            return {"weights": weights(emb), "reference": weights(ref), "grad_sparse": grad_sparse}
        return section

    def zero_grad_error(opt):
        try:
            opt.zero_grad()
        except AssertionError as exc:
            return str(exc)
        return None

    def zero_grad_guard():
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "zero_grad"))
        mse(model, *shard(0)).backward()
        error = zero_grad_error(opt)
        opt.step()  # the reductions still complete
        opt.zero_grad()  # and after step() zero_grad is fine again
        return {"error": error, "grads_cleared": all(p.grad is None for p in model.parameters())}

    def zero_grad_while_accumulating():
        # backward_passes_per_step=2: after one pass the gradient waits locally for the second;
        # zero_grad() now would throw it away, so it raises (as Horovod's does).
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "zg.acc"),
                                       backward_passes_per_step=2)
        mse(model, *shard(0)).backward()
        error = zero_grad_error(opt)
        mse(model, *shard(1)).backward()
        opt.step()
        opt.zero_grad()  # a whole accumulated step is done: fine again
        return {"error": error, "grads_cleared": all(p.grad is None for p in model.parameters())}

    def rewrap():
        # Phase 1 with SGD, then the optimizer is dropped and Adam wraps the same model under the
        # same names (a fine-tuning phase): the old hooks must go with the old optimizer.
        import gc

        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "rewrap"))
        train(opt, model, steps=3)
        del opt
        gc.collect()
        opt = hvd.DistributedOptimizer(adam(model.parameters()), named_parameters=named(model, "rewrap"))
        out = {"weights": train(opt, model, steps=3)}
        if r == 0:
            ref = make_model()
            for make, steps in ((sgd, range(3)), (adam, range(3))):
                ref_opt = make(ref.parameters())
                for s in steps:
                    ref_opt.zero_grad()
                    mse(ref, *data(s)).backward()
                    ref_opt.step()
            out["reference"] = weights(ref)
        return out

    def group_split():
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Linear(8, 2), torch.nn.Linear(2, 2))
        params = list(model.parameters())  # 6 tensors
        sizes = {}
        for groups in (3, 4, 6, 9):
            opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, f"split{groups}"),
                                           groups=groups)
            sizes[groups] = [len(g) for g in opt._groups]
            assert [p for g in opt._groups for p in g] == params
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "split.both"),
                                           num_groups=2, groups=3)
        return {"sizes": sizes, "both": [len(g) for g in opt._groups],
                "warned": [str(w.message) for w in caught]}

    def sparse_handle_callable():
        t = torch.sparse_coo_tensor(torch.tensor([[r, 3]]), torch.tensor([1.0 + r, 10.0]), (5,))
        handle = hvd.sparse_allreduce_async(t, "sparse.callable", hvd.Sum)
        called = handle().to_dense()
        again = hvd.synchronize(handle).to_dense()
        return {"called": called, "again": again}

    def too_many_backward_passes():
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "too_many"))
        mse(model, *shard(0)).backward()
        try:
            mse(model, *shard(1)).backward()
            error = None
        except AssertionError as exc:
            error = str(exc)
        opt.synchronize()  # drain what the first pass started
        return error

    def skip_synchronize_warnings():
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "skip"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(2):
                opt.zero_grad()
                mse(model, *shard(s)).backward()
                opt.synchronize()
                with opt.skip_synchronize():
                    opt.step()
        quiet = [str(w.message) for w in caught]
        # without skip_synchronize(), step() after synchronize() warns (and reduces again)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.zero_grad()
            mse(model, *shard(0)).backward()
            opt.synchronize()
            opt.step()
        return {"quiet": quiet, "noisy": [str(w.message) for w in caught]}

    def skip_synchronize_weights():
        # synchronize() explicitly, clip the averaged gradients, then step() without reducing again
        def clip(model):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)

        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "skipw"))
        for s in range(5):
            opt.zero_grad()
            mse(model, *shard(s)).backward()
            opt.synchronize()
            clip(model)
            with opt.skip_synchronize():
                opt.step()
        return with_reference(sgd, weights(model), steps=5, before_step=clip)

    def class_identity():
        model = make_model()
        s = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=named(model, "cls.s"))
        model2 = make_model()
        a = hvd.DistributedOptimizer(torch.optim.Adam(model2.parameters()), named_parameters=named(model2, "cls.a"))
        return {"sgd": isinstance(s, torch.optim.SGD), "optimizer": isinstance(s, torch.optim.Optimizer),
                "adam": isinstance(a, torch.optim.Adam), "adam_not_sgd": not isinstance(a, torch.optim.SGD),
                "name": type(s).__name__}

    def scheduler_after_wrapping():
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "sched.after"))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            w = train(opt, model, sched=sched)
        out = with_reference(sgd, w, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5))
        out["lr"] = opt.param_groups[0]["lr"]
        out["warnings"] = [str(c.message) for c in caught]
        return out

    def scheduler_before_wrapping():
        # A script may build the scheduler on the plain optimizer, then wrap it (Horovod allows it:
        # the wrapper shares the parameter groups, so the schedule still applies).
        model = make_model()
        inner = sgd(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(inner, step_size=5, gamma=0.5)
        opt = hvd.DistributedOptimizer(inner, named_parameters=named(model, "sched.before"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()", as in Horovod
            w = train(opt, model, sched=sched)
        out = with_reference(sgd, w, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5))
        out["lr"] = opt.param_groups[0]["lr"]
        return out

    def state_dict_roundtrip():
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "sd.a"))
        train(opt, model, steps=3)
        saved_opt = copy.deepcopy(opt.state_dict())
        saved_model = copy.deepcopy(model.state_dict())
        continued = train(opt, model, steps=3)
        model2 = make_model(seed=99)
        model2.load_state_dict(saved_model)
        opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.7),
                                        named_parameters=named(model2, "sd.b"))
        opt2.load_state_dict(saved_opt)
        resumed = train(opt2, model2, steps=3)
        return {"keys": sorted(saved_opt),
                "has_momentum": all("momentum_buffer" in v for v in saved_opt["state"].values()),
                "lr": opt2.param_groups[0]["lr"], "continued": continued, "resumed": resumed}

    def closure_steps(make_opt, prefix, steps=STEPS):
        # step(closure): the closure's own gradients are the ones averaged and applied. L-BFGS calls
        # the closure several times a step and decides from its loss, so each call must see the
        # averaged gradients and the averaged (whole-batch) loss.
        def run(opt, model, rows_of):
            losses = []
            for s in range(steps):
                x, y = rows_of(s)

                def closure(x=x, y=y):
                    opt.zero_grad()
                    loss = mse(model, x, y)
                    loss.backward()
                    return loss
                losses.append(float(opt.step(closure)))
            return weights(model), losses

        def section():
            model = make_model()
            opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=named(model, prefix))
            w, losses = run(opt, model, shard)
            out = {"weights": w, "losses": losses}
            if r == 0:
                ref_model = make_model()
                out["reference"], out["reference_losses"] = run(make_opt(ref_model.parameters()), ref_model, data)
            return out
        return section

    def buckets_vs_per_tensor():
        # Gradients in flat buckets (the default) and one reduction per tensor give identical bits,
        # for a model whose 40 tensors make several buckets (a 1000-byte cap) and for fp16 compression.
        import os

        def deep():
            torch.manual_seed(3)
            return torch.nn.Sequential(*[torch.nn.Linear(5, 5) for _ in range(20)])

        def run(cap, prefix, compression):
            os.environ["HORA_GRADIENT_BUCKET_BYTES"] = str(cap)
            try:
                model = deep()
                opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, prefix),
                                               compression=compression)
                buckets = len(opt._buckets)
                for s in range(5):
                    x, _ = shard(s)
                    opt.zero_grad()
                    model(x).pow(2).mean().backward()
                    opt.step()
                return weights(model), buckets
            finally:
                del os.environ["HORA_GRADIENT_BUCKET_BYTES"]
        out = {}
        for label, compression in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16)):
            out[label] = {"bucketed": run(1000, f"bk.{label}", compression),
                          "per_tensor": run(0, f"pt.{label}", compression)}
        return out

    def with_bucket_bytes(cap, build):
        import os

        os.environ["HORA_GRADIENT_BUCKET_BYTES"] = str(cap)
        try:
            return build()
        finally:
            del os.environ["HORA_GRADIENT_BUCKET_BYTES"]

    def bucket_views_layout():
        # Bucketed gradients are views of one flat buffer per bucket (PyTorch DDP's
        # gradient_as_bucket_view): every step leaves them there, a step after
        # zero_grad(set_to_none=False) copies nothing into or out of a flat tensor (no more copy
        # operations than plain torch's own backward), zero_grad() still leaves None, and the
        # gradients equal per-tensor reductions (HORA_GRADIENT_BUCKET_BYTES=0) bit for bit.
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        class Copies(TorchDispatchMode):
            watched = ("cat", "split", "split_with_sizes", "copy_", "_foreach_copy_")

            def __init__(self):
                super().__init__()
                self.seen = Counter()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket.__name__ in self.watched:
                    self.seen[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        runs = {}
        for label, cap in (("bucketed", VIEW_CAP), ("per_tensor", 0), ("plain", None)):
            model = conv_model()
            if cap is None:
                runs[label] = (model, sgd(model.parameters()))
                continue
            runs[label] = (model, with_bucket_bytes(cap, lambda model=model, label=label: hvd.DistributedOptimizer(
                sgd(model.parameters()), named_parameters=named(model, f"views.{label}"))))
        out = {"buckets": [[p.shape for p in b] for b in runs["bucketed"][1]._buckets], "steps": []}
        for s, mode in enumerate(("none", "zeros", "zeros", "none", "assigned")):
            x, y = conv_data(s, r)
            step = {}
            for label, (model, opt) in runs.items():
                if mode == "assigned":  # the user's own gradients, which backward adds to
                    for p in model.parameters():
                        p.grad = torch.full_like(p, 0.5)
                else:
                    opt.zero_grad(set_to_none=mode == "none")
                cleared = all(p.grad is None for p in model.parameters())
                with Copies() as copies:
                    mse(model, x, y).backward()
                    if label != "plain":
                        opt.synchronize()
                params = list(model.parameters())
                step[label] = {"copies": dict(copies.seen), "cleared": cleared,
                               "grads": [p.grad.clone() for p in params]}
                if label == "bucketed":
                    step["storages"] = [sorted({p.grad.untyped_storage().data_ptr() for p in b}) for b in opt._buckets]
                    step["strides"] = [(p.grad.stride(), p.stride()) for p in params]
                    step["dtypes"] = [p.grad.dtype for p in params]
                if label == "plain":
                    opt.step()
                else:
                    with opt.skip_synchronize():
                        opt.step()
            step["mode"] = mode
            out["steps"].append(step)
        out.update({label: {"weights": weights(model)} for label, (model, _) in runs.items() if label != "plain"})
        return out

    def bucket_views_training(variant):
        # Bucketed against per-tensor reductions, bit for bit, where views of a flat buffer meet torch's
        # corners: accumulation over backward_passes_per_step=2 into kept gradients, fp16 compression,
        # a model turned float64 part-way (module.to() converts the gradients in place, so each bucket's
        # buffer must be cut again), and a sparse gradient in a bucket (its own per-tensor path).
        def run(cap, label):
            if variant == "sparse":
                torch.manual_seed(8)
                model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 2))
            else:
                model = conv_model()
            kwargs = {"bpps2": {"backward_passes_per_step": 2},
                      "fp16": {"compression": hvd.Compression.fp16}}.get(variant, {})
            inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if variant in ("to_double", "sparse")
                                    else 0.9)
            opt = with_bucket_bytes(cap, lambda: hvd.DistributedOptimizer(
                inner, named_parameters=named(model, f"views.{variant}.{label}"), **kwargs))
            dtype = torch.float32
            for s in range(4):
                if variant == "to_double" and s == 2:
                    model.double()
                    dtype = torch.float64
                opt.zero_grad(set_to_none=variant == "fp16" and s % 2 == 0)
                if variant == "sparse":
                    idx = (torch.tensor([[0, 1, 2, 2], [2, 3, 4, 9]])[r % 2] + s) % 10
                    model(idx).pow(2).mean().backward()
                else:
                    x, y = conv_data(s, r, dtype)
                    passes = 2 if variant == "bpps2" else 1
                    for i in range(passes):
                        (mse(model, x[i::passes], y[i::passes]) / passes).backward()
                opt.step()
            out = {"weights": weights(model), "buckets": len(opt._buckets)}
            if cap and variant != "sparse":
                out["storages"] = [len({p.grad.untyped_storage().data_ptr() for p in b}) for b in opt._buckets]
                out["dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
            return out
        return lambda: {"bucketed": run(VIEW_CAP, "bk"), "per_tensor": run(0, "pt")}

    def lbfgs(params):
        return torch.optim.LBFGS(params, lr=0.5, max_iter=4, history_size=5)

    return [
        ("equivalence.sgd", equivalence(sgd, "eq.sgd")),
        ("buckets_vs_per_tensor", buckets_vs_per_tensor),
        ("bucket_views.layout", bucket_views_layout),
        ("bucket_views.bpps2", bucket_views_training("bpps2")),
        ("bucket_views.fp16", bucket_views_training("fp16")),
        ("bucket_views.to_double", bucket_views_training("to_double")),
        ("bucket_views.sparse", bucket_views_training("sparse")),
        ("closure.sgd", closure_steps(sgd, "closure.sgd")),
        ("closure.adam", closure_steps(adam, "closure.adam")),
        ("closure.lbfgs", closure_steps(lbfgs, "closure.lbfgs", steps=5)),
        ("equivalence.adam", equivalence(adam, "eq.adam")),
        ("equivalence.fp16", equivalence(sgd, "eq.fp16", compression=hvd.Compression.fp16)),
        ("fp16.gradients", fp16_gradients),
        ("bpps.2", accumulate(2, use_setter=False)),
        ("bpps.4", accumulate(4, use_setter=False)),
        ("bpps.setter", accumulate(2, use_setter=True)),
        ("order.two_losses", hook_order_two_losses),
        ("order.one_backward", hook_order_one_backward),
        ("missing_gradients", missing_gradients),
        ("groups.int", groups_variant("int")),
        ("groups.list", groups_variant("list")),
        ("groups.num_groups", groups_variant("num_groups")),
        ("groups.one_group", groups_variant("one_group")),
        ("predivide", groups_variant("predivide")),
        ("op_sum", op_sum),
        ("sparse.sgd", sparse(False, "sgd")),
        ("sparse_as_dense.sgd", sparse(True, "sgd")),
        ("sparse.sparse_adam", sparse(False, "sparse_adam")),
        ("sparse_as_dense.sparse_adam", sparse(True, "sparse_adam")),
        ("zero_grad_guard", zero_grad_guard),
        ("too_many_backward_passes", too_many_backward_passes),
        ("zero_grad_while_accumulating", zero_grad_while_accumulating),
        ("rewrap", rewrap),
        ("group_split", group_split),
        ("sparse_handle_callable", sparse_handle_callable),
        ("skip_synchronize", skip_synchronize_warnings),
        ("skip_synchronize.weights", skip_synchronize_weights),
        ("class_identity", class_identity),
        ("scheduler.after_wrapping", scheduler_after_wrapping),
        ("scheduler.before_wrapping", scheduler_before_wrapping),
        ("state_dict", state_dict_roundtrip),
    ]


RANKS2 = SharedJob(_job, np=2)  # one 2-rank job for every hora.torch module


@pytest.fixture(scope="module")
def ranks2(request) -> JobResults:
    return RANKS2.results(request)


def assert_close_lists(got, want, **tol):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert torch.allclose(g, w, **(tol or TOL)), (g - w).abs().max()


def assert_ranks_agree_and_match_reference(job, section, **tol):
    """Both ranks hold identical weights, equal (within float tolerance) to rank 0's reference."""
    ranks = job.all(section)
    for got in ranks[1:]:
        for a, b in zip(ranks[0]["weights"], got["weights"]):
            assert torch.equal(a, b), f"{section}: ranks disagree"
    assert_close_lists(ranks[0]["weights"], ranks[0]["reference"], **tol)


# ---- (a) 2 workers on half batches == 1 worker on the whole batch -------------------------------


@pytest.mark.parametrize("section", ["equivalence.sgd", "equivalence.adam"])
def test_two_workers_match_one_worker_2ranks(ranks2, section):
    assert_ranks_agree_and_match_reference(ranks2, section)


# ---- (b) local gradient aggregation --------------------------------------------------------------


def test_bucketed_gradients_are_bit_identical_to_per_tensor_reductions_2ranks(ranks2):
    for rank in ranks2.all("buckets_vs_per_tensor"):
        for label in ("none", "fp16"):
            (bucketed, buckets), (per_tensor, none) = rank[label]["bucketed"], rank[label]["per_tensor"]
            assert buckets >= 3 and none == 0, (buckets, none)
            for a, b in zip(bucketed, per_tensor):
                assert torch.equal(a, b), label


def test_bucketed_gradients_are_views_of_one_flat_buffer_per_bucket_2ranks(ranks2):
    for rank in ranks2.all("bucket_views.layout"):
        assert len(rank["buckets"]) == 4, rank["buckets"]
        assert torch.Size([4, 4, 3, 3]) in [shape for b in rank["buckets"] for shape in b]
        first = rank["steps"][0]["storages"]
        for step in rank["steps"]:
            # one buffer per bucket, a different one for each, the same one every step
            assert step["storages"] == first and all(len(s) == 1 for s in first), step["storages"]
            assert len({s[0] for s in first}) == len(first)
            # the layout autograd gives a gradient (the channels_last weight's strides among them)
            assert all(grad == param for grad, param in step["strides"]), step["strides"]
            assert step["dtypes"] == [torch.float32] * 14
            assert step["bucketed"]["cleared"] == (step["mode"] == "none")
            for a, b in zip(step["bucketed"]["grads"], step["per_tensor"]["grads"]):
                assert torch.equal(a, b), step["mode"]


def test_kept_bucketed_gradients_are_reduced_without_copies_2ranks(ranks2):
    """After zero_grad(set_to_none=False) the bucketed step adds no copy to plain torch's backward pass;
    after zero_grad() (gradients made anew by autograd) each gradient is copied in once, and nothing
    is copied back."""
    for rank in ranks2.all("bucket_views.layout"):
        for step in rank["steps"]:
            copies, plain = step["bucketed"]["copies"], step["plain"]["copies"]
            if step["mode"] == "zeros":
                assert copies == plain, (copies, plain)
            else:  # one copy in per bucket, none out
                assert {**copies, "_foreach_copy_": 0} == {**plain, "_foreach_copy_": 0}, (copies, plain)
                assert copies["_foreach_copy_"] - plain.get("_foreach_copy_", 0) <= len(rank["buckets"]), copies


def test_bucket_views_train_like_per_tensor_reductions_2ranks(ranks2):
    for section in ("bucket_views.layout", "bucket_views.bpps2", "bucket_views.fp16", "bucket_views.to_double",
                    "bucket_views.sparse"):
        ranks = ranks2.all(section)
        for got in ranks:
            for a, b in zip(got["bucketed"]["weights"], got["per_tensor"]["weights"]):
                assert torch.equal(a, b), section
        for a, b in zip(*(got["bucketed"]["weights"] for got in ranks)):
            assert torch.equal(a, b), f"{section}: ranks disagree"


def test_bucket_buffers_follow_a_dtype_change_2ranks(ranks2):
    for got in ranks2.all("bucket_views.to_double"):
        bucketed = got["bucketed"]
        assert bucketed["buckets"] == 4 and bucketed["storages"] == [1] * 4
        assert bucketed["dtypes"] == ["torch.float64"]


@pytest.mark.parametrize("section", ["closure.sgd", "closure.adam", "closure.lbfgs"])
def test_step_with_closure_averages_the_closures_gradients_2ranks(ranks2, section):
    """Horovod averages before running the closure; hora runs it, then averages, then steps."""
    assert_ranks_agree_and_match_reference(ranks2, section)
    ranks = ranks2.all(section)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the returned loss is the ranks' average
    assert ranks[0]["losses"] == pytest.approx(ranks[0]["reference_losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("section", ["bpps.2", "bpps.4", "bpps.setter"])
def test_backward_passes_per_step_equals_larger_batches_2ranks(ranks2, section):
    """k local passes per step (each on 16 / (2 k) rows, loss scaled by 1/k) == 1 worker on 16 rows.

    Horovod semantics: the gradients of the k passes are summed locally (plain autograd accumulation),
    and only then averaged across ranks; hence the 1/k on each micro-batch's mean loss.
    """
    assert_ranks_agree_and_match_reference(ranks2, section)


# ---- (c) fp16 compression ------------------------------------------------------------------------


def test_fp16_compression_gradients_within_fp16_tolerance_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("fp16.gradients", r)
        assert got["dtypes"] == [torch.float32] * 4  # decompressed back into the float32 gradients
        assert_close_lists(got["grads"], got["reference"], rtol=2e-3, atol=1e-4)


def test_fp16_compression_training_stays_close_2ranks(ranks2):
    ranks = ranks2.all("equivalence.fp16")
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(a, b)
    # 20 momentum steps on fp16-rounded gradients: close to, not equal to, the float32 run
    assert_close_lists(ranks[0]["weights"], ranks[0]["reference"], rtol=1e-2, atol=1e-3)


# ---- (d) hooks firing in different orders on different ranks --------------------------------------


def test_hooks_in_different_orders_two_losses_2ranks(ranks2):
    assert ranks2.get("order.two_losses", 0)["fired"] == [0, 1, 2, 3, 4, 5]
    assert ranks2.get("order.two_losses", 1)["fired"] == [5, 4, 3, 2, 1, 0]
    for r in range(2):
        got = ranks2.get("order.two_losses", r)
        assert_close_lists(got["weights"], got["reference"])


def test_hooks_in_different_orders_one_backward_2ranks(ranks2):
    assert ranks2.get("order.one_backward", 0)["fired"] == ["b", "a"]
    assert ranks2.get("order.one_backward", 1)["fired"] == ["a", "b"]
    for r in range(2):
        got = ranks2.get("order.one_backward", r)
        assert_close_lists(got["weights"], got["reference"])


# ---- (e) parameters without a gradient --------------------------------------------------------------


def test_parameters_without_gradients_do_not_hang_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("missing_gradients", r)
        # Reference: the plain average over ranks of each rank's loss. Horovod's convention is that
        # a rank with no gradient for a parameter contributes zeros, which is exactly that average.
        assert_close_lists(got["weights"], got["reference"])
        # "never" is used by no rank: zero gradients, so plain SGD leaves it as it was
        never = got["weights"][4:]
        assert_close_lists(never, got["never_initial"])


# ---- (f) groups, predivide, op=Sum, sparse --------------------------------------------------------


@pytest.mark.parametrize("section", ["groups.int", "groups.list", "groups.num_groups", "groups.one_group",
                                     "predivide"])
def test_groups_and_predivide_match_one_worker_2ranks(ranks2, section):
    assert_ranks_agree_and_match_reference(ranks2, section)


def test_op_sum_sums_gradients_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("op_sum", r)
        assert_close_lists(got["grads"], got["reference"])


@pytest.mark.parametrize("section", ["sparse.sgd", "sparse_as_dense.sgd", "sparse.sparse_adam",
                                     "sparse_as_dense.sparse_adam"])
def test_sparse_embedding_gradients_2ranks(ranks2, section):
    for r in range(2):
        got = ranks2.get(section, r)
        assert_close_lists(got["weights"], got["reference"])
        # sparse_as_dense reduces dense tensors but, as in Horovod, hands the optimizer sparse
        # gradients again (SparseAdam accepts nothing else)
        assert got["grad_sparse"] == [True] * 5
    assert torch.equal(ranks2.get(section, 0)["weights"][0], ranks2.get(section, 1)["weights"][0])


# ---- (g) the optimizer interface --------------------------------------------------------------------


def test_zero_grad_between_backward_and_step_raises_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("zero_grad_guard", r)
        assert got["error"] is not None and "zero_grad" in got["error"]
        assert got["grads_cleared"]


def test_zero_grad_while_accumulating_locally_raises_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("zero_grad_while_accumulating", r)
        assert got["error"] is not None and "zero_grad" in got["error"]
        assert got["grads_cleared"]


def test_a_new_optimizer_over_the_same_model_replaces_the_old_one_2ranks(ranks2):
    assert_ranks_agree_and_match_reference(ranks2, "rewrap")


def test_int_groups_split_parameters_into_that_many_groups_2ranks(ranks2):
    got = ranks2.get("group_split", 0)
    assert got["sizes"] == {3: [2, 2, 2], 4: [2, 2, 1, 1], 6: [1] * 6, 9: [1] * 6}
    assert got["both"] == [2, 2, 2]  # groups wins over the deprecated num_groups, with a warning
    assert any("num_groups" in w for w in got["warned"])


def test_sparse_allreduce_async_handle_is_callable_2ranks(ranks2):
    want = torch.tensor([1.0, 2.0, 0.0, 20.0, 0.0])
    for r in range(2):
        got = ranks2.get("sparse_handle_callable", r)
        assert torch.equal(got["called"], want) and torch.equal(got["again"], want)


def test_more_backward_passes_than_configured_raise_2ranks(ranks2):
    for r in range(2):
        error = ranks2.get("too_many_backward_passes", r)
        assert error is not None and "backward_passes_per_step" in error


def test_skip_synchronize_with_explicit_synchronize_2ranks(ranks2):
    assert_ranks_agree_and_match_reference(ranks2, "skip_synchronize.weights")
    for r in range(2):
        got = ranks2.get("skip_synchronize", r)
        assert got["quiet"] == []
        # Horovod's text, which scripts filter warnings by
        assert any(m.startswith("optimizer.step() called without optimizer.skip_synchronize()") for m in got["noisy"])


def test_wrapped_optimizer_is_an_instance_of_its_class_2ranks(ranks2):
    got = ranks2.get("class_identity", 0)
    assert got == {"sgd": True, "optimizer": True, "adam": True, "adam_not_sgd": True, "name": "SGD"}


def test_lr_scheduler_on_the_wrapped_optimizer_2ranks(ranks2):
    assert_ranks_agree_and_match_reference(ranks2, "scheduler.after_wrapping")
    for r in range(2):
        got = ranks2.get("scheduler.after_wrapping", r)
        assert got["lr"] == pytest.approx(0.1 * 0.5 ** (STEPS // 5))
        assert not [w for w in got["warnings"] if "lr_scheduler" in w], got["warnings"]


def test_lr_scheduler_built_before_wrapping_2ranks(ranks2):
    assert_ranks_agree_and_match_reference(ranks2, "scheduler.before_wrapping")
    assert ranks2.get("scheduler.before_wrapping", 1)["lr"] == pytest.approx(0.1 * 0.5 ** (STEPS // 5))


def test_state_dict_round_trip_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("state_dict", r)
        assert got["keys"] == ["param_groups", "state"] and got["has_momentum"]
        assert got["lr"] == 0.1  # the loaded hyper-parameters replace the new optimizer's
        assert_close_lists(got["resumed"], got["continued"], rtol=0, atol=0)


# ---- state loading, subclassing, parameter order ------------------------------------------------

# Short stall limits: a section whose ranks wait on different names fails in seconds, not minutes.
RULES_ENV = {"HORA_STALL_CHECK_TIME_SECONDS": "3", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "8"}


def _job_wrapper_rules() -> list:
    import copy
    import warnings

    import hora.torch as hvd

    r, n = hvd.rank(), hvd.size()

    def shard(step):
        return rank_shard(step, r, n)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def train(opt, model, steps, first=0, passes=1):
        for s in range(first, first + steps):
            opt.zero_grad()
            for _ in range(passes):
                (mse(model, *shard(s)) / passes).backward()
            opt.step()
        return weights(model)

    def step_after_synchronize_warns():
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "rules.warn"))
        mse(model, *shard(0)).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        return [str(w.message) for w in caught]

    def load_state_dict_mid_step(passes):
        # Train, save, start another step (one backward pass: with passes=1 its reductions are in
        # flight, with passes=2 it waits locally for the second), then load the saved state instead
        # of finishing it. Training on must match a fresh optimizer that loaded the same state.
        def section():
            model = make_model()
            opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                           named_parameters=named(model, f"rules.load{passes}"),
                                           backward_passes_per_step=passes)
            train(opt, model, 2, passes=passes)
            saved_model = copy.deepcopy(model.state_dict())
            saved_opt = copy.deepcopy(opt.state_dict())
            mse(model, *shard(7)).backward()
            model.load_state_dict(saved_model)
            opt.load_state_dict(copy.deepcopy(saved_opt))  # torch adopts the tensors, then updates them
            resumed = train(opt, model, 2, first=2, passes=passes)
            fresh = make_model()
            fresh.load_state_dict(saved_model)
            opt2 = hvd.DistributedOptimizer(sgd(fresh.parameters()),
                                            named_parameters=named(fresh, f"rules.fresh{passes}"),
                                            backward_passes_per_step=passes)
            opt2.load_state_dict(saved_opt)
            return {"resumed": resumed, "fresh": train(opt2, fresh, 2, first=2, passes=passes)}
        return section

    def subclassed_again():
        # A library patching step() by deriving from the wrapped optimizer's class.
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named(model, "rules.sub"))
        calls = []

        class Patched(type(opt)):
            def step(self, closure=None):
                calls.append(1)
                return super().step(closure)

        opt.__class__ = Patched
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        out = {"weights": train(opt, model, 5), "calls": len(calls)}
        if r == 0:
            out["reference"] = reference_train(sgd, steps=5)
        return out

    def groups_in_rank0_order():
        # Rank 1 hands its optimizer the parameters in reverse order: groups must still be cut from
        # rank 0's order (by name), or the ranks reduce different tensors under each group's name.
        model = make_model()
        params = list(model.parameters())
        opt = hvd.DistributedOptimizer(sgd(params if r == 0 else params[::-1]),
                                       named_parameters=named(model, "rules.order"), groups=2)
        out = {"weights": train(opt, model, 5), "groups": [[p.shape for p in g] for g in opt._groups]}
        if r == 0:
            out["reference"] = reference_train(sgd, steps=5)
        return out

    return [
        ("step_after_synchronize", step_after_synchronize_warns),
        ("load_state_dict.in_flight", load_state_dict_mid_step(1)),
        ("load_state_dict.accumulating", load_state_dict_mid_step(2)),
        ("subclassed_again", subclassed_again),
        ("groups.rank0_order", groups_in_rank0_order),
    ]


@pytest.fixture(scope="module")
def rules2() -> JobResults:
    from sections import _job_main

    import hora

    return JobResults(hora.run(_job_main, args=(None, _job_wrapper_rules), np=2, env=RULES_ENV))


def test_step_after_synchronize_warns_with_horovods_text_2ranks(rules2):
    for r in range(2):
        messages = rules2.get("step_after_synchronize", r)
        assert any(m.startswith("optimizer.step() called without optimizer.skip_synchronize()") for m in messages)


@pytest.mark.parametrize("section", ["load_state_dict.in_flight", "load_state_dict.accumulating"])
def test_load_state_dict_mid_step_starts_the_next_step_afresh_2ranks(rules2, section):
    for r in range(2):
        got = rules2.get(section, r)
        assert_close_lists(got["resumed"], got["fresh"], rtol=0, atol=0)


def test_subclass_of_the_wrapped_class_steps_once_2ranks(rules2):
    assert_ranks_agree_and_match_reference(rules2, "subclassed_again")
    assert rules2.get("subclassed_again", 0)["calls"] == 5


def test_int_groups_follow_rank0_parameter_order_2ranks(rules2):
    assert rules2.get("groups.rank0_order", 0)["groups"] == rules2.get("groups.rank0_order", 1)["groups"]
    assert_ranks_agree_and_match_reference(rules2, "groups.rank0_order")


# ---- known engine bug ---------------------------------------------------------------------------


def _job_shared_group_names() -> list:
    import hora.torch as hvd

    r = hvd.rank()

    def two_optimizers():
        # Without named_parameters both optimizers name their first group "allreduce.noname.0",
        # with members of different shapes: the engine must renegotiate, not hang.
        out = []
        for width in (8, 3):
            torch.manual_seed(width)
            model = torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Linear(width, 2))
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=1)
            for s in range(2):
                opt.zero_grad()
                mse(model, *data(s, 4)).backward()
                opt.step()
            out.append(weights(model))
        return {"rank": r, "weights": out}

    return [("two_optimizers", two_optimizers)]


GROUP_NAMES2 = SharedJob(_job_shared_group_names, np=2)


def test_two_grouped_optimizers_sharing_names_2ranks(request):
    job = GROUP_NAMES2.results(request)
    a, b = job.all("two_optimizers")
    for wa, wb in zip(a["weights"], b["weights"]):
        for x, y in zip(wa, wb):
            assert torch.equal(x, y)


def _job_process_set_excludes_a_rank() -> list:
    import hora.torch as hvd

    r = hvd.rank()

    def optimizer_on_a_subset():
        # Ranks 0 and 1 train together in a process set; rank 2 wraps the same optimizer but is not
        # in the set: as in Horovod it takes no part (no hooks, synchronize has nothing to do).
        pair = hvd.add_process_set([0, 1])
        try:
            model = make_model()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=named(model, "ps.opt"), process_set=pair)
            half = BATCH // 2
            for s in range(3):
                x, y = data(s)
                rows = slice(r * half, (r + 1) * half) if r < 2 else slice(0, BATCH)
                opt.zero_grad()
                mse(model, x[rows], y[rows]).backward()
                opt.step()
            return weights(model)
        finally:
            hvd.barrier()
            hvd.remove_process_set(pair)

    return [("subset", optimizer_on_a_subset)]


SUBSET3 = SharedJob(_job_process_set_excludes_a_rank, np=3)  # one 3-rank job for every hora.torch module


def test_optimizer_on_a_process_set_leaves_other_ranks_alone_3ranks(request):
    job = SUBSET3.results(request)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(3):
        opt.zero_grad()
        mse(ref, *data(s)).backward()
        opt.step()
    for r in range(3):  # ranks 0, 1: averaged halves; rank 2: the whole batch on its own, no allreduce
        assert_close_lists(job.get("subset", r), weights(ref))
