"""hora.torch helpers on 2 ranks: broadcast_parameters, broadcast_optimizer_state, broadcast_object,
allgather_object, and SyncBatchNorm against torch.nn.BatchNorm on the concatenated batch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sections import JobResults, SharedJob  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the first test runs every module's share of the job

SBN_ROWS = (3, 5)  # rank 0 and rank 1 batch sizes: SyncBatchNorm must weigh them by count


def make_model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


def clone_state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def sbn_data(shape_tail: tuple, channels: int = 3):
    """Every rank's input and upstream weights; the same on every rank, so each can build the reference."""
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(rows, channels, *shape_tail, generator=g) * 2 + 1 for rows in SBN_ROWS]
    ws = [torch.randn(rows, channels, *shape_tail, generator=g) for rows in SBN_ROWS]
    return xs, ws


# ---- the job ----------------------------------------------------------------------------------


def _job() -> list:
    import hora.torch as hvd

    r = hvd.rank()

    def parameters_state_dict():
        model = make_model(seed=10 + r)  # different weights on every rank
        model(torch.randn(4, 4))  # running stats and num_batches_tracked differ too
        before = clone_state(model)
        hvd.broadcast_parameters(model.state_dict(), root_rank=1)
        return {"before": before, "after": clone_state(model)}

    def parameters_named():
        model = make_model(seed=20 + r)
        before = clone_state(model)
        hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
        return {"before": before, "after": clone_state(model)}

    def parameters_list():
        model = make_model(seed=30 + r)
        before = clone_state(model)
        hvd.broadcast_parameters(list(model.parameters()), root_rank=1)
        return {"before": before, "after": clone_state(model)}

    def optimizer_state(kind, wrap):
        def section():
            torch.manual_seed(40)
            model = torch.nn.Linear(4, 2)  # same weights everywhere, as after broadcast_parameters
            if kind == "sgd":
                opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if r == 0
                       else torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.3, weight_decay=0.1))
            else:
                opt = (torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9)) if r == 0
                       else torch.optim.Adam(model.parameters(), lr=0.3, weight_decay=0.1))
            if r == 0:  # rank 0 has trained (locally) and has state; rank 1 has none
                for s in range(3):
                    opt.zero_grad()
                    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(s))).pow(2).mean().backward()
                    opt.step()
                    # keep the weights equal on both ranks: only the optimizer state should move
                    with torch.no_grad():
                        torch.manual_seed(40)
                        fresh = torch.nn.Linear(4, 2)
                        model.weight.copy_(fresh.weight)
                        model.bias.copy_(fresh.bias)
            if wrap:
                opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"bos.{kind}.{n}", p)
                                                                      for n, p in model.named_parameters()])
            weights_before = [p.detach().clone() for p in model.parameters()]
            grads_before = [p.grad for p in model.parameters()]
            had_state = len(opt.state) > 0
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                     for p in model.parameters()]
            return {"had_state": had_state, "hyper": hyper, "state": state,
                    "weights_unchanged": all(torch.equal(a, p) for a, p in zip(weights_before, model.parameters())),
                    "grads_unchanged": all(a is p.grad for a, p in zip(grads_before, model.parameters()))}
        return section

    def optimizer_state_sparse_adam():
        torch.manual_seed(41)
        emb = torch.nn.Embedding(6, 2, sparse=True)
        opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1 if r == 0 else 0.5)
        if r == 0:
            for s in range(2):
                opt.zero_grad()
                emb(torch.tensor([s, 3])).sum().backward()
                opt.step()
            with torch.no_grad():
                torch.manual_seed(41)
                emb.weight.copy_(torch.nn.Embedding(6, 2).weight)
        weights_before = emb.weight.detach().clone()
        grad_before = emb.weight.grad
        had_state = len(opt.state) > 0
        hvd.broadcast_optimizer_state(opt, root_rank=0, model=emb)
        state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[emb.weight].items()}
        return {"had_state": had_state, "hyper": [{k: v for k, v in g.items() if k != "params"}
                                                  for g in opt.param_groups],
                "state": [state], "weights_unchanged": torch.equal(weights_before, emb.weight),
                "grads_unchanged": emb.weight.grad is grad_before}

    def optimizer_state_partial(kind):
        """Rank 0 has state for the first layer only (the second joined later by add_param_group):
        creating the missing state must leave the existing state exactly as it was."""
        def section():
            torch.manual_seed(42)
            first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
            make = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)) if kind == "sgd" \
                else (lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01))
            opt = make(first.parameters())
            if r == 0:
                for s in range(3):
                    opt.zero_grad()
                    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(s))
                    first(x).pow(2).mean().backward()
                    opt.step()
            opt.add_param_group({"params": list(second.parameters())})
            if r == 0:  # keep the weights equal on both ranks: only optimizer state should differ
                with torch.no_grad():
                    torch.manual_seed(42)
                    first.load_state_dict(torch.nn.Linear(3, 3).state_dict())
            before = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                      for p in first.parameters()]
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            after = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                     for p in [*first.parameters(), *second.parameters()]]
            return {"before": before, "after": after}
        return section

    def objects():
        obj = {"rank": r, "payload": list(range(r * 3)), "tensor": torch.arange(r + 1)}
        return {
            "from0": hvd.broadcast_object(obj),
            "from1": hvd.broadcast_object(obj, root_rank=1, name="bo.1"),
            "gathered": hvd.allgather_object(obj),
            "gathered_named": hvd.allgather_object(("x" * (r * 100), r), name="ago.named"),
        }

    def sync_batch_norm(shape_tail, momentum, affine=True):
        def section():
            xs, ws = sbn_data(shape_tail)
            torch.manual_seed(50)
            sbn = hvd.SyncBatchNorm(3, momentum=momentum, affine=affine)
            if affine:
                with torch.no_grad():
                    sbn.weight.uniform_(0.5, 1.5)
                    sbn.bias.uniform_(-0.5, 0.5)
            outputs, grads = [], []
            for step in range(2):  # two steps: the running statistics accumulate
                x = (xs[r] + step).requires_grad_()
                sbn.zero_grad()
                out = sbn(x)
                (out * ws[r]).sum().backward()
                outputs.append(out.detach())
                grads.append({"x": x.grad})
                if affine:
                    grads[-1].update(weight=sbn.weight.grad.clone(), bias=sbn.bias.grad.clone())
            # weight/bias gradients are per rank; their sum over ranks is the whole batch's gradient
            summed = {k: hvd.allreduce(grads[-1][k], op=hvd.Sum, name=f"sbn.{shape_tail}.{momentum}.{k}")
                      for k in ("weight", "bias") if affine}
            sbn.eval()
            evaluated = sbn(xs[r]).detach()
            return {"outputs": outputs, "grads": grads, "summed": summed, "running_mean": sbn.running_mean.clone(),
                    "running_var": sbn.running_var.clone(), "batches": int(sbn.num_batches_tracked), "eval": evaluated}
        return section

    return [
        ("parameters.state_dict", parameters_state_dict),
        ("parameters.named", parameters_named),
        ("parameters.list", parameters_list),
        ("optimizer.sgd", optimizer_state("sgd", wrap=False)),
        ("optimizer.adam", optimizer_state("adam", wrap=False)),
        ("optimizer.sgd.wrapped", optimizer_state("sgd", wrap=True)),
        ("optimizer.adam.wrapped", optimizer_state("adam", wrap=True)),
        ("optimizer.sparse_adam", optimizer_state_sparse_adam),
        ("optimizer.partial.sgd", optimizer_state_partial("sgd")),
        ("optimizer.partial.adam", optimizer_state_partial("adam")),
        ("objects", objects),
        ("sbn.2d", sync_batch_norm((), 0.1)),
        ("sbn.3d", sync_batch_norm((4,), 0.1)),
        ("sbn.cumulative", sync_batch_norm((), None)),
        ("sbn.no_affine", sync_batch_norm((2, 2), 0.1, affine=False)),  # 4-D input too
    ]


RANKS2 = SharedJob(_job, np=2)  # one 2-rank job for every hora.torch module


@pytest.fixture(scope="module")
def ranks2(request) -> JobResults:
    return RANKS2.results(request)


# ---- broadcast_parameters -----------------------------------------------------------------------


@pytest.mark.parametrize("section,root", [("parameters.state_dict", 1), ("parameters.named", 0),
                                          ("parameters.list", 1)])
def test_broadcast_parameters_2ranks(ranks2, section, root):
    root_before = ranks2.get(section, root)["before"]
    other_before = ranks2.get(section, 1 - root)["before"]
    assert not torch.equal(root_before["0.weight"], other_before["0.weight"])  # they did differ
    for r in range(2):
        after = ranks2.get(section, r)["after"]
        for key, value in after.items():
            buffer = key.startswith("1.") and not key.endswith(("weight", "bias"))
            if section == "parameters.state_dict" or not buffer:
                assert torch.equal(value, root_before[key]), (r, key)
            else:  # parameters only: each rank's own BatchNorm buffers stay
                assert torch.equal(value, ranks2.get(section, r)["before"][key]), (r, key)


def test_broadcast_parameters_state_dict_includes_buffers_2ranks(ranks2):
    after = ranks2.get("parameters.state_dict", 0)["after"]
    assert after["1.num_batches_tracked"].shape == () and int(after["1.num_batches_tracked"]) == 1
    assert torch.equal(after["1.running_mean"], ranks2.get("parameters.state_dict", 1)["before"]["1.running_mean"])


# ---- broadcast_optimizer_state ---------------------------------------------------------------------


@pytest.mark.parametrize("section", ["optimizer.sgd", "optimizer.adam", "optimizer.sgd.wrapped",
                                     "optimizer.adam.wrapped", "optimizer.sparse_adam"])
def test_broadcast_optimizer_state_2ranks(ranks2, section):
    root, other = ranks2.get(section, 0), ranks2.get(section, 1)
    assert root["had_state"] and not other["had_state"]
    # hyper-parameters (lr, momentum, betas, weight_decay, ...) now equal rank 0's
    assert other["hyper"] == root["hyper"]
    # per-parameter state was initialised on rank 1 and now equals rank 0's
    assert len(other["state"]) == len(root["state"])
    for mine, theirs in zip(other["state"], root["state"]):
        assert sorted(mine) == sorted(theirs) and mine, mine
        for key, value in theirs.items():
            if torch.is_tensor(value):
                assert torch.equal(mine[key], value), key
            else:
                assert mine[key] == value, key
    # initialising the state (a step on zero gradients) left the weights and gradients alone
    for r in range(2):
        got = ranks2.get(section, r)
        assert got["weights_unchanged"] and got["grads_unchanged"]


def test_broadcast_optimizer_state_adam_step_count_2ranks(ranks2):
    state = ranks2.get("optimizer.adam", 1)["state"][0]
    assert float(state["step"]) == 3.0  # rank 0 took 3 steps
    assert ranks2.get("optimizer.sgd", 1)["hyper"][0]["momentum"] == 0.9


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_broadcast_optimizer_state_keeps_existing_state_when_some_is_missing_2ranks(ranks2, kind):
    root, other = ranks2.get(f"optimizer.partial.{kind}", 0), ranks2.get(f"optimizer.partial.{kind}", 1)
    assert root["before"][0] and not other["before"][0]
    for before, after in zip(root["before"], root["after"]):  # rank 0's trained state, bit for bit
        assert sorted(before) == sorted(after)
        for key, value in before.items():
            assert torch.equal(after[key], value) if torch.is_tensor(value) else after[key] == value, key
    if kind == "adam":
        assert float(root["after"][0]["step"]) == 3.0
    assert len(other["after"]) == len(root["after"]) == 4
    for mine, theirs in zip(other["after"], root["after"]):  # the new layer's state was created on both
        assert mine and sorted(mine) == sorted(theirs)
        for key, value in theirs.items():
            assert torch.equal(mine[key], value) if torch.is_tensor(value) else mine[key] == value, key


# ---- objects ------------------------------------------------------------------------------------


def test_broadcast_object_and_allgather_object_2ranks(ranks2):
    objs = [{"rank": k, "payload": list(range(k * 3)), "tensor": torch.arange(k + 1)} for k in range(2)]

    def same(a, b):
        return a["rank"] == b["rank"] and a["payload"] == b["payload"] and torch.equal(a["tensor"], b["tensor"])

    for r in range(2):
        got = ranks2.get("objects", r)
        assert same(got["from0"], objs[0]) and same(got["from1"], objs[1])
        assert len(got["gathered"]) == 2 and all(same(g, o) for g, o in zip(got["gathered"], objs))
        assert got["gathered_named"] == [("", 0), ("x" * 100, 1)]


# ---- SyncBatchNorm --------------------------------------------------------------------------------


def _reference_batch_norm(shape_tail: tuple, momentum, affine: bool):
    """torch.nn.BatchNorm on the concatenated global batch, same affine init and the same two steps."""
    xs, ws = sbn_data(shape_tail)
    torch.manual_seed(50)
    bn = (torch.nn.BatchNorm1d if len(shape_tail) < 2 else torch.nn.BatchNorm2d)(3, momentum=momentum, affine=affine)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    outputs, grads = [], []
    for step in range(2):
        x = (torch.cat(xs) + step).requires_grad_()
        bn.zero_grad()
        out = bn(x)
        (out * torch.cat(ws)).sum().backward()
        outputs.append(out.detach())
        grads.append({"x": x.grad})
        if affine:
            grads[-1].update(weight=bn.weight.grad.clone(), bias=bn.bias.grad.clone())
    bn.eval()
    evaluated = bn(torch.cat(xs)).detach()
    return {"outputs": outputs, "grads": grads, "running_mean": bn.running_mean, "running_var": bn.running_var,
            "batches": int(bn.num_batches_tracked), "eval": evaluated}


@pytest.mark.parametrize("section,shape_tail,momentum,affine", [
    ("sbn.2d", (), 0.1, True), ("sbn.3d", (4,), 0.1, True), ("sbn.cumulative", (), None, True),
    ("sbn.no_affine", (2, 2), 0.1, False),
])
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch_2ranks(ranks2, section, shape_tail, momentum, affine):
    ref = _reference_batch_norm(shape_tail, momentum, affine)
    tol = dict(rtol=1e-5, atol=1e-5)
    starts = [0, SBN_ROWS[0]]
    for r in range(2):
        got = ranks2.get(section, r)
        rows = slice(starts[r], starts[r] + SBN_ROWS[r])
        for step in range(2):
            assert torch.allclose(got["outputs"][step], ref["outputs"][step][rows], **tol), (r, step)
            assert torch.allclose(got["grads"][step]["x"], ref["grads"][step]["x"][rows], **tol), (r, step)
        assert sorted(got["summed"]) == (["bias", "weight"] if affine else [])
        for key in got["summed"]:
            assert torch.allclose(got["summed"][key], ref["grads"][-1][key], **tol), (r, key)
        assert torch.allclose(got["running_mean"], ref["running_mean"], **tol)
        assert torch.allclose(got["running_var"], ref["running_var"], **tol)  # unbiased, global count
        assert got["batches"] == ref["batches"] == 2
        assert torch.allclose(got["eval"], ref["eval"][rows], **tol)


def test_sync_batch_norm_local_weight_gradients_differ_per_rank_2ranks(ranks2):
    # each rank's weight.grad is its own share (a DistributedOptimizer then reduces them)
    a, b = (ranks2.get("sbn.2d", r)["grads"][-1]["weight"] for r in range(2))
    assert not torch.allclose(a, b)
    assert torch.allclose(a + b, ranks2.get("sbn.2d", 0)["summed"]["weight"])
