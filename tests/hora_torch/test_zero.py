"""hora.torch's ZeroRedundancyOptimizer (ZeRO stage 1) on 2 and 3 ranks, and memory_report.

The bar: sharding the optimizer state changes where the state lives, not the training. So a sharded
run ends with the weights of the unsharded ``hvd.DistributedOptimizer`` run on the same data (within
fp32 round-off: the averages come from a reducescatter instead of an allreduce), each rank holds
about 1/N of the state, and a state consolidated at 3 ranks continues the same trajectory when loaded
at 2 ranks or into a plain unsharded torch optimizer. 3 ranks give uneven shards. One job per world
size; the 2-rank job loads the 3-rank job's checkpoint, so it runs second.
"""

from __future__ import annotations

import copy
import functools

import pytest

torch = pytest.importorskip("torch")

from sections import JobResults, SharedJob, run_job  # noqa: E402
from zero_models import (  # noqa: E402
    ADAM,
    FROZEN,
    NAMES,
    SGD_MOMENTUM,
    assert_close_lists,
    data,
    loss_of,
    make_model,
    shard,
    weights,
)

pytestmark = pytest.mark.timeout(300)  # the first test runs every module's share of the job

STEPS = 50
SAVE_AFTER, CONTINUE = 10, 5  # the checkpoint: saved after 10 steps, compared over the next 5


def adam(params):
    return ADAM[0](params, **ADAM[1])


def sgd(params):
    return SGD_MOMENTUM[0](params, **SGD_MOMENTUM[1])


def train(opt, model, steps, r, n, first: int = 0):
    for s in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, *shard(s, r, n)).backward()
        opt.step()
    return weights(model)


def reference_train(model, opt, steps, first: int = 0):
    """One unsharded worker on the whole batch (the average of equal shards' mean losses)."""
    for s in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, *data(s)).backward()
        opt.step()
    return weights(model)


# ---- the job ------------------------------------------------------------------------------------


def _job(checkpoint=None) -> list:
    import hora.torch as hvd
    from hora.torch.zero import ZeroRedundancyOptimizer
    from hora.torch.zero_memory import memory_report

    r, n = hvd.rank(), hvd.size()

    def named(model, prefix):
        return [(f"{prefix}.{name}", p) for name, p in model.named_parameters()]

    def against_distributed(optimizer, prefix, chunk_bytes=None, **zero_kwargs):
        cls, settings = optimizer

        def section():
            model = make_model()
            opt = ZeroRedundancyOptimizer(model.parameters(), cls, **zero_kwargs, **settings)
            if chunk_bytes is not None:
                opt.chunk_bytes = chunk_bytes
            sharded = train(opt, model, STEPS, r, n)
            plain = make_model()
            hopt = hvd.DistributedOptimizer(cls(plain.parameters(), **settings), named_parameters=named(plain, prefix))
            out = {"sharded": sharded, "distributed": train(hopt, plain, STEPS, r, n),
                   "float32_calls": opt._calls(torch.float32)}
            if opt.parameters_as_bucket_view:
                ptrs = {p.untyped_storage().data_ptr() for p in model.parameters() if p.dtype == torch.float32}
                out["float32_storages"] = len(ptrs)
            return out
        return section

    def state_bytes():
        torch.manual_seed(5)
        layers = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
        plain = copy.deepcopy(layers)
        x = torch.randn(4, 32)
        opt = ZeroRedundancyOptimizer(layers.parameters(), torch.optim.Adam, lr=0.01)
        hopt = hvd.DistributedOptimizer(torch.optim.Adam(plain.parameters(), lr=0.01),
                                        named_parameters=named(plain, "bytes"))
        for model, o in ((layers, opt), (plain, hopt)):
            for _ in range(2):
                o.zero_grad()
                model(x).square().mean().backward()
                o.step()
        return {"sharded": memory_report(opt), "distributed": memory_report(hopt)}

    def plan_everywhere():
        opt = ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.SGD, lr=0.1)
        return {"bounds": opt.shard_plan.bounds, "sizes": opt.shard_plan.sizes,
                "local": [tuple(p.shape) for g in opt.optim.param_groups for p in g["params"]],
                "groups_keys": sorted(opt.param_groups[0])}

    def checkpoint_round_trip():
        # Save after SAVE_AFTER steps at this world size, on the last rank (to= need not be 0), then
        # continue three ways: the sharded optimizer itself, a fresh sharded one loading the state,
        # and the unsharded DistributedOptimizer loading it.
        last = n - 1
        model = make_model()
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        train(opt, model, SAVE_AFTER, r, n)
        opt.consolidate_state_dict(to=last)
        try:
            saved = opt.state_dict()
            refused = None
        except RuntimeError as exc:
            saved, refused = None, str(exc)
        saved = hvd.broadcast_object(saved, root_rank=last)
        saved_weights = weights(model)
        resumed = make_model()
        with torch.no_grad():
            for p, w in zip(resumed.parameters(), saved_weights):
                p.copy_(w)
        plain = copy.deepcopy(resumed)
        reloaded = ZeroRedundancyOptimizer(resumed.parameters(), torch.optim.Adam, lr=0.5)  # lr comes from the state
        reloaded.load_state_dict(copy.deepcopy(saved))
        hopt = hvd.DistributedOptimizer(torch.optim.Adam(plain.parameters(), lr=0.5),
                                        named_parameters=named(plain, "ckpt"))
        hopt.load_state_dict(copy.deepcopy(saved))
        out = {
            "refused": refused,
            "continued": train(opt, model, CONTINUE, r, n, first=SAVE_AFTER),
            "reloaded": train(reloaded, resumed, CONTINUE, r, n, first=SAVE_AFTER),
            "distributed": train(hopt, plain, CONTINUE, r, n, first=SAVE_AFTER),
            "lr": reloaded.param_groups[0]["lr"],
        }
        if r == last:
            out["checkpoint"] = {"state": saved, "weights": saved_weights}
        return out

    def load_foreign_checkpoint():
        # the checkpoint another world size consolidated: every rank loads all of it, keeps its shard
        model = make_model()
        with torch.no_grad():
            for p, w in zip(model.parameters(), checkpoint["weights"]):
                p.copy_(w)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        opt.load_state_dict(copy.deepcopy(checkpoint["state"]))
        kept = sorted(opt._index[p] for p in opt.state)
        return {"weights": train(opt, model, CONTINUE, r, n, first=SAVE_AFTER), "kept": kept,
                "owned": list(opt._owned)}

    def add_group(bucket_view):
        def section():
            # Fine-tuning's pattern: layer c joins later, with its own lr. The shards are planned again
            # over every parameter, and the Adam state already built moves to its new owners.
            model = make_model()
            head = list(model.c.parameters())
            body = [p for name, p in model.named_parameters() if not name.startswith("c.")]
            opt = ZeroRedundancyOptimizer(body, torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=0.01)
            before = opt.shard_plan.bounds
            train(opt, model, 3, r, n)
            opt.add_param_group({"params": head, "lr": 0.02})
            got = train(opt, model, 3, r, n, first=3)
            out = {"weights": got, "before": before, "after": opt.shard_plan.bounds,
                   "lrs": [g["lr"] for g in opt.param_groups]}
            if r == 0:
                ref = make_model()
                ref_head = list(ref.c.parameters())
                ref_opt = torch.optim.Adam([p for name, p in ref.named_parameters() if not name.startswith("c.")],
                                           lr=0.01)
                reference_train(ref, ref_opt, 3)
                ref_opt.add_param_group({"params": ref_head, "lr": 0.02})
                out["reference"] = reference_train(ref, ref_opt, 3, first=3)
            return out
        return section

    def closure_step():
        model = make_model()
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
        losses = []
        for s in range(3):
            x, y = shard(s, r, n)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                return loss
            losses.append(opt.step(closure).item())
        out = {"weights": weights(model), "losses": losses}
        if r == 0:
            ref = make_model()
            ref_opt = sgd(ref.parameters())
            ref_losses = []
            for s in range(3):
                ref_opt.zero_grad()
                loss = loss_of(ref, *data(s))
                loss.backward()
                ref_losses.append(loss.item())
                ref_opt.step()
            out["reference"] = weights(ref)
            out["reference_losses"] = ref_losses
        return out

    def scheduler():
        # an LR scheduler changes param_groups; the local optimizer must step with the new lr
        model = make_model()
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for s in range(3):
            opt.zero_grad()
            loss_of(model, *shard(s, r, n)).backward()
            opt.step()
            sched.step()
        out = {"weights": weights(model), "local_lrs": [g["lr"] for g in opt.optim.param_groups]}
        if r == 0:
            ref = make_model()
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
            for s in range(3):
                ref_opt.zero_grad()
                loss_of(ref, *data(s)).backward()
                ref_opt.step()
                ref_sched.step()
            out["reference"] = weights(ref)
        return out

    def refusals():
        out = {}
        model = make_model()
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        try:
            opt.state_dict()
        except RuntimeError as exc:
            out["not_consolidated"] = str(exc)
        try:
            opt.consolidate_state_dict(to=n + 5)
        except ValueError as exc:
            out["bad_to"] = str(exc)
        try:
            opt.load_state_dict({"state": {}, "param_groups": []})
        except ValueError as exc:
            out["bad_groups"] = str(exc)
        try:  # each rank holds another shard's state: refused on every rank before anything is sent
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        except ValueError as exc:
            out["broadcast_state"] = str(exc)
        viewed = make_model()
        bucketed = ZeroRedundancyOptimizer(viewed.parameters(), torch.optim.SGD, parameters_as_bucket_view=True, lr=0.1)
        with torch.no_grad():
            viewed.a.weight.data = viewed.a.weight.data.clone()  # out of its bucket
        try:
            bucketed.step()
        except RuntimeError as exc:
            out["left_bucket"] = str(exc)
        extra = [torch.nn.Parameter(torch.zeros(3))] if r == 0 else []
        # Checked at the first collective, not when built (a rank joining an elastic job builds alone).
        different = ZeroRedundancyOptimizer(list(make_model().parameters()) + extra, torch.optim.SGD, lr=0.1)
        try:
            different.step()
        except ValueError as exc:
            out["different_params"] = str(exc)
        return out

    sections = [
        ("adam", against_distributed(ADAM, "adam")),
        ("sgd_momentum", against_distributed(SGD_MOMENTUM, "sgd")),
        ("adam_bucket_view", against_distributed(ADAM, "adam.bv", parameters_as_bucket_view=True)),
        # pieces of 100 bytes: every shard moves in several collectives, and parameters straddle them
        ("adam_chunked", against_distributed(ADAM, "adam.ch", chunk_bytes=100)),
        ("sgd_bucket_view_chunked", against_distributed(SGD_MOMENTUM, "sgd.bv.ch", chunk_bytes=100,
                                                        parameters_as_bucket_view=True)),
        ("state_bytes", state_bytes),
        ("plan_everywhere", plan_everywhere),
        ("checkpoint_round_trip", checkpoint_round_trip),
        ("add_group", add_group(False)),
        ("add_group_bucket_view", add_group(True)),
        ("closure", closure_step),
        ("scheduler", scheduler),
        ("refusals", refusals),
    ]
    if checkpoint is not None:
        sections.append(("foreign_checkpoint", load_foreign_checkpoint))
    if n == 3:
        sections.append(("process_set", _process_set_section(hvd, ZeroRedundancyOptimizer, r)))
    return sections


def _process_set_section(hvd, ZeroRedundancyOptimizer, r):
    def section():
        # ranks 0 and 2 shard between them; rank 1 is outside the set and steps everything alone
        pair = hvd.add_process_set([0, 2])
        try:
            model = make_model()
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_set=pair, lr=0.01)
            member = {0: 0, 2: 1}.get(r)
            for s in range(4):
                x, y = shard(s, member, 2) if member is not None else data(s)
                opt.zero_grad()
                loss_of(model, x, y).backward()
                opt.step()
            return {"weights": weights(model), "owned": list(opt._owned), "members": opt.shard_plan.ranks}
        finally:
            hvd.barrier()
            hvd.remove_process_set(pair)
    return section


# The 3-rank job is every hora.torch module's; the 2-rank one loads this job's 3-rank checkpoint, so it
# runs on its own, after it.
RANKS3 = SharedJob(_job, np=3)


@pytest.fixture(scope="module")
def ranks3(request) -> JobResults:
    return RANKS3.results(request)


@pytest.fixture(scope="module")
def ranks2(ranks3) -> JobResults:
    checkpoint = ranks3.get("checkpoint_round_trip", 2)["checkpoint"]
    return run_job(functools.partial(_job, checkpoint), np=2)


@pytest.fixture(params=["ranks2", "ranks3"])
def job(request) -> JobResults:
    return request.getfixturevalue(request.param)


# ---- same weights as the unsharded DistributedOptimizer -----------------------------------------


@pytest.mark.parametrize("section", ["adam", "sgd_momentum", "adam_bucket_view", "adam_chunked",
                                     "sgd_bucket_view_chunked"])
def test_sharded_steps_match_the_unsharded_distributed_optimizer(job, section):
    for r in range(job.size):
        out = job.get(section, r)
        assert_close_lists(out["sharded"], out["distributed"])
        # the default moves each dtype in one piece here; 100-byte pieces take several collectives
        if "chunked" in section:
            assert out["float32_calls"] >= 4
        else:
            assert out["float32_calls"] == 1
    first = job.get(section, 0)["sharded"]
    for r in range(1, job.size):  # every rank ends with every parameter, the same
        for a, b in zip(first, job.get(section, r)["sharded"]):
            assert torch.equal(a, b)


def test_bucket_view_puts_each_dtypes_parameters_in_one_buffer(job):
    for r in range(job.size):
        assert job.get("adam_bucket_view", r)["float32_storages"] == 1


def test_frozen_parameter_is_left_alone(job):
    for r in range(job.size):
        assert torch.equal(job.get("adam", r)["sharded"][FROZEN], make_model().shift.detach())


# ---- memory -------------------------------------------------------------------------------------


def test_each_rank_holds_its_share_of_the_optimizer_state(job):
    n = job.size
    reports = [job.get("state_bytes", r) for r in range(n)]
    full = reports[0]["distributed"].optimizer_state
    assert full == 2 * 6 * (32 * 32 + 32) * 4 + 12 * 4  # Adam: two moments and a step per parameter
    shares = [rep["sharded"].optimizer_state for rep in reports]
    assert sum(shares) == full  # every parameter's state on exactly one rank
    assert max(shares) <= full / n * 1.01
    for rep in reports:  # stage 1 shards the state only
        assert rep["sharded"].parameters == rep["distributed"].parameters
        assert rep["sharded"].gradients == rep["distributed"].gradients


def test_memory_report_of_a_plain_optimizer():
    from hora.torch.zero_memory import memory_report

    model = torch.nn.Linear(10, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = memory_report(opt)
    assert (before.parameters, before.gradients, before.optimizer_state) == (33 * 4, 0, 0)
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    after = memory_report(opt)
    assert (after.parameters, after.gradients, after.optimizer_state) == (33 * 4, 33 * 4, 33 * 4)
    assert after.total == 3 * 33 * 4


# ---- the plan -----------------------------------------------------------------------------------


def test_every_rank_uses_the_same_plan(job):
    from hora.binding.shard_plan import plan_shards

    sizes = [p.numel() * p.element_size() for p in make_model().parameters()]
    plans = [job.get("plan_everywhere", r) for r in range(job.size)]
    assert all(p["bounds"] == plan_shards(sizes, job.size).bounds for p in plans)
    local = [shape for p in plans for shape in p["local"]]
    assert local == [tuple(p.shape) for p in make_model().parameters()]  # each parameter on one rank
    assert "betas" not in plans[0]["groups_keys"]  # SGD's full settings, visible as torch's are
    assert {"lr", "momentum", "nesterov", "params"} <= set(plans[0]["groups_keys"])


# ---- checkpoints --------------------------------------------------------------------------------


def test_consolidated_state_continues_identically_at_the_same_world_size(job):
    for r in range(job.size):
        out = job.get("checkpoint_round_trip", r)
        assert_close_lists(out["reloaded"], out["continued"])
        assert_close_lists(out["distributed"], out["continued"])
        assert out["lr"] == 0.01
        if r != job.size - 1:
            assert "consolidate_state_dict" in out["refused"]
        else:
            assert out["refused"] is None


def test_state_saved_at_3_ranks_continues_at_2_ranks_and_unsharded(ranks3, ranks2):
    saved = ranks3.get("checkpoint_round_trip", 2)
    checkpoint, continued_at_3 = saved["checkpoint"], saved["continued"]
    state = checkpoint["state"]
    assert sorted(state["state"]) == [i for i in range(len(NAMES)) if i != FROZEN]  # it never had state
    assert state["param_groups"][0]["params"] == list(range(len(NAMES)))
    for r in range(2):
        out = ranks2.get("foreign_checkpoint", r)
        assert out["kept"] == [i for i in out["owned"] if i != FROZEN]  # only this rank's shard
        assert_close_lists(out["weights"], continued_at_3)
    # a consolidated checkpoint is torch's ordinary format: a plain optimizer loads it
    model = make_model()
    with torch.no_grad():
        for p, w in zip(model.parameters(), checkpoint["weights"]):
            p.copy_(w)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    opt.load_state_dict(copy.deepcopy(state))
    assert_close_lists(reference_train(model, opt, CONTINUE, first=SAVE_AFTER), continued_at_3)


# ---- the rest of torch's interface --------------------------------------------------------------


@pytest.mark.parametrize("section", ["add_group", "add_group_bucket_view"])
def test_add_param_group_replans_and_moves_the_state(job, section):
    ref = job.get(section, 0)["reference"]
    for r in range(job.size):
        out = job.get(section, r)
        assert out["lrs"] == [0.01, 0.02]
        assert out["before"][-1] == len(NAMES) - 2 and out["after"][-1] == len(NAMES)
        assert_close_lists(out["weights"], ref)


def test_closure_averages_gradients_and_loss(job):
    ref = job.get("closure", 0)
    for r in range(job.size):
        out = job.get("closure", r)
        assert_close_lists(out["weights"], ref["reference"])
        assert out["losses"] == pytest.approx(ref["reference_losses"], rel=1e-5)


def test_lr_scheduler_reaches_the_local_optimizer(job):
    ref = job.get("scheduler", 0)["reference"]
    for r in range(job.size):
        out = job.get("scheduler", r)
        assert_close_lists(out["weights"], ref)
        assert out["local_lrs"] == [0.1 * 0.5 ** 2]  # the lr of the last step (one before the last sched.step)


def test_process_set_shards_among_its_members_only(ranks3):
    model = make_model()
    ref = reference_train(model, adam(model.parameters()), 4)
    for r in (0, 2):
        out = ranks3.get("process_set", r)
        assert out["members"] == 2
        assert_close_lists(out["weights"], ref)
    alone = ranks3.get("process_set", 1)  # outside the set: its own whole batch, every parameter its own
    assert alone["members"] == 1 and alone["owned"] == list(range(len(NAMES)))
    assert_close_lists(alone["weights"], ref)


# ---- refusals -----------------------------------------------------------------------------------


def test_refusals_inside_a_job(job):
    for r in range(job.size):
        out = job.get("refusals", r)
        assert "consolidate_state_dict(to=" in out["not_consolidated"]
        assert "not in the process set" in out["bad_to"]
        assert "parameter groups" in out["bad_groups"]
        assert "same parameters in the same order" in out["different_params"]
        assert "no longer lives in its bucket" in out["left_bucket"]
        assert "consolidate_state_dict" in out.get("broadcast_state", ""), out


def test_torch_process_group_is_refused():
    from hora.torch.zero import ZeroRedundancyOptimizer

    with pytest.raises(TypeError, match="hora process set"):
        ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.SGD, process_group=object(), lr=0.1)


def test_overlap_with_ddp_is_refused():
    from hora.errors import UnsupportedOperationError
    from hora.torch.zero import ZeroRedundancyOptimizer

    with pytest.raises(UnsupportedOperationError, match="no DistributedDataParallel") as info:
        ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, ValueError)


def test_signature_is_torchs():
    """torch's parameters in torch's order with torch's defaults; hora's process_set only by keyword."""
    import inspect

    from hora.torch.zero import ZeroRedundancyOptimizer

    theirs_cls = pytest.importorskip("torch.distributed.optim").ZeroRedundancyOptimizer

    def shape(fn, drop=()):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in drop]

    assert shape(ZeroRedundancyOptimizer, drop={"process_set"}) == shape(theirs_cls)
    assert inspect.signature(ZeroRedundancyOptimizer).parameters["process_set"].kind is inspect.Parameter.KEYWORD_ONLY
    for method in ("step", "consolidate_state_dict", "state_dict", "load_state_dict", "add_param_group", "zero_grad"):
        assert shape(getattr(ZeroRedundancyOptimizer, method)) == shape(getattr(theirs_cls, method)), method


def test_optimizer_class_must_be_a_torch_optimizer_class():
    from hora.torch.zero import ZeroRedundancyOptimizer

    with pytest.raises(TypeError, match="optimizer_class"):
        ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.SGD(make_model().parameters(), lr=0.1))
