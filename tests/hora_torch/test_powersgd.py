"""hora.torch.powersgd: PowerSGD with error feedback, checked two ways.

Without processes, through a one-rank communicator: orthogonalization, exactness at full rank,
DDP's min_compression_rate rule, the warm-up, and the state's round trip. In ONE 2-rank job
(sections, as the other hora.torch tests run theirs): the results against a float64 NumPy
re-computation of the algorithm from both ranks' gradients, identical gradients on every rank,
error feedback over many steps, a checkpoint resumed mid-run, and the elements sent for a
ResNet-18-shaped parameter list at rank 4.
"""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from compression_helpers import RESNET18_PARAMETERS, OneRank, resnet18_shapes, resumed_difference  # noqa: E402
from sections import JobResults, SharedJob  # noqa: E402

from hora.compression import Compression  # noqa: E402
from hora.errors import UnsupportedOperationError  # noqa: E402
from hora.torch.powersgd import (  # noqa: E402
    PowerSGDReducer,
    compressed_shape,
    initial_q,
    orthogonalize_,
    state_for_new_world,
)

pytestmark = pytest.mark.timeout(300)  # the first test runs every module's share of the job


def reducer(comm=None, **options) -> PowerSGDReducer:
    return PowerSGDReducer(Compression.powersgd(**options), communicator=comm or OneRank())


# ---- without processes --------------------------------------------------------------------------


def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(50, 4, generator=g, dtype=torch.float64)
    before = p.clone()
    out = orthogonalize_(p)
    assert out is p
    torch.testing.assert_close(p.t() @ p, torch.eye(4, dtype=torch.float64))
    # same column space: projecting the original columns onto the new ones changes nothing
    torch.testing.assert_close(p @ (p.t() @ before), before)


def test_orthogonalize_leaves_zero_and_tiny_columns_zero_instead_of_nan() -> None:
    p = torch.tensor([[1.0, 0.0, 2.0, 1e-12], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    orthogonalize_(p, epsilon=1e-9)
    assert torch.isfinite(p).all()
    assert p[:, 1].abs().sum() == 0 and p[:, 3].abs().sum() == 0
    for i in (0, 2):
        assert abs(float(p[:, i].norm()) - 1) < 1e-6
    assert abs(float(p[:, 0] @ p[:, 2])) < 1e-6
    zero = torch.zeros(5, 3)
    assert torch.equal(orthogonalize_(zero), torch.zeros(5, 3))  # epsilon 0: an exact zero column is still safe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_at_least_min_of_the_sides_is_exact_on_one_rank(dtype) -> None:
    # min_compression_rate=0 compresses every matrix; r = min(n, m) spans the whole column space
    g = torch.Generator().manual_seed(1)
    grads = {"tall": torch.randn(9, 4, generator=g, dtype=dtype), "wide": torch.randn(3, 8, generator=g, dtype=dtype),
             "conv": torch.randn(4, 2, 3, 3, generator=g, dtype=dtype)}
    red = reducer(rank=9, start_iter=0, min_compression_rate=0.0)
    assert all(v is not None for v in red.plan([(k, v.shape) for k, v in grads.items()]).values())
    for step in range(3):
        work = {k: v.clone() for k, v in grads.items()}
        red.reduce(list(work.items()))
        for k in grads:
            torch.testing.assert_close(work[k], grads[k])
        for k, err in red.state_dict()["error"].items():
            assert float(err.abs().max()) < (1e-5 if dtype == torch.float32 else 1e-12), (step, k)


@pytest.mark.parametrize(("shape", "rank", "rate", "expected"), [
    ((64, 3, 7, 7), 4, 2.0, (64, 147, 4)),   # (64+147)*4*2 = 1688 < 9408
    ((1000, 512), 4, 2.0, (1000, 512, 4)),
    ((10, 10), 4, 2.0, None),                # (10+10)*4*2 = 160 >= 100
    ((10, 10), 4, 1.0, (10, 10, 4)),         # 80 < 100
    ((10, 10), 2, 2.0, (10, 10, 2)),         # 80 < 100
    ((16, 8), 4, 2.0, None),                 # 192 >= 128: DDP's strict "<"
    ((4, 2), 9, 0.0, (4, 2, 2)),             # r capped at min(n, m)
    ((512,), 4, 2.0, None),                  # vectors go uncompressed
    ((), 4, 0.0, None),
    ((0, 5), 4, 0.0, None),
])
def test_min_compression_rate_rule(shape, rank, rate, expected) -> None:
    assert compressed_shape(shape, rank, rate) == expected


def test_resnet18_plan_at_rank_4_is_under_a_twentieth() -> None:
    shapes = resnet18_shapes()
    assert sum(math.prod(s) for _, s in shapes) == RESNET18_PARAMETERS
    plan = reducer(rank=4).plan(shapes)
    sent = sum(math.prod(s) if plan[n] is None else (plan[n][0] + plan[n][1]) * plan[n][2] for n, s in shapes)
    assert sent * 20 <= RESNET18_PARAMETERS, sent


def test_warm_up_steps_send_everything_in_one_plain_group_then_p_and_q() -> None:
    comm = OneRank()
    red = reducer(comm, rank=2, start_iter=2)
    grads = [("w", torch.randn(20, 30)), ("b", torch.randn(20)), ("tiny", torch.randn(3, 3))]
    for _ in range(3):
        sent = red.reduce([(n, g.clone()) for n, g in grads])
    assert red.step == 3
    assert comm.calls[:2] == [("powersgd.warmup", 20 * 30 + 20 + 9)] * 2
    assert sorted(comm.calls[2:]) == sorted([("powersgd.plain", 20 + 9), ("powersgd.P", 20 * 2),
                                             ("powersgd.Q", 30 * 2)])
    assert (sent.plain, sent.p, sent.q, sent.uncompressed) == (29, 40, 60, 629)
    assert sent.sent_bytes == 4 * sent.sent and sent.uncompressed_bytes == 4 * 629


def test_half_precision_gradients_are_computed_and_kept_in_float32() -> None:
    red = reducer(rank=1, start_iter=0, min_compression_rate=0.0)
    grad = torch.randn(6, 5).to(torch.bfloat16)
    red.reduce([("w", grad)])
    assert grad.dtype == torch.bfloat16
    state = red.state_dict()
    assert state["error"]["w"].dtype == torch.float32 and state["q"]["w"].dtype == torch.float32
    assert red.last_sent is not None and red.last_sent.sent_bytes == 4 * (6 + 5)


def test_warm_start_off_draws_a_fresh_seeded_q_each_step() -> None:
    assert torch.equal(initial_q("w", 5, 2, seed=3), initial_q("w", 5, 2, seed=3))
    assert not torch.equal(initial_q("w", 5, 2, seed=3), initial_q("v", 5, 2, seed=3))
    assert not torch.equal(initial_q("w", 5, 2, seed=3, step=1), initial_q("w", 5, 2, seed=3, step=2))
    red = reducer(rank=1, start_iter=0, min_compression_rate=0.0, warm_start=False)
    red.reduce([("w", torch.randn(6, 5))])
    assert red.state_dict()["q"] == {}


def _steps(count: int, seed: int = 7) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[("fc.weight", torch.randn(24, 16, generator=g)), ("fc.bias", torch.randn(24, generator=g)),
             ("conv.weight", torch.randn(8, 4, 3, 3, generator=g))] for _ in range(count)]


def test_state_dict_round_trip_resumes_bit_identically() -> None:
    steps = _steps(8)
    options = dict(rank=2, start_iter=2)

    def run(red: PowerSGDReducer, grads_list) -> list[list[tuple[str, torch.Tensor]]]:
        outputs = []
        for grads in grads_list:
            work = [(n, g.clone()) for n, g in grads]
            red.reduce(work)
            outputs.append(work)
        return outputs

    whole = reducer(**options)
    wanted = run(whole, steps)
    first = reducer(**options)
    run(first, steps[:5])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain tensors, ints and containers only
    resumed = reducer(**options)
    resumed.load_state_dict(saved)
    assert resumed.step == 5
    got = run(resumed, steps[5:])
    for want_step, got_step in zip(wanted[5:], got):
        for (name, a), (_, b) in zip(want_step, got_step):
            assert torch.equal(a, b), name
    for part in ("q", "error"):
        mine, theirs = resumed.state_dict()[part], whole.state_dict()[part]
        assert mine.keys() == theirs.keys() and mine
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert resumed.step == whole.step == 8


def test_state_from_another_world_keeps_q_and_step_and_drops_residuals() -> None:
    red = reducer(OneRank(0, 2), rank=2, start_iter=0)
    for grads in _steps(2):
        red.reduce(grads)
    state = copy.deepcopy(red.state_dict())
    assert state["world"] == [0, 2] and state["error"]
    for comm in (OneRank(1, 2), OneRank(0, 3)):  # another rank's checkpoint; an elastic resize
        other = reducer(comm, rank=2, start_iter=0)
        other.load_state_dict(state)
        got = other.state_dict()
        assert got["step"] == 2 and got["error"] == {} and got["q"].keys() == state["q"].keys()
    same = reducer(OneRank(0, 2), rank=2, start_iter=0)
    same.load_state_dict(state)
    assert same.state_dict()["error"].keys() == state["error"].keys()
    assert state_for_new_world(state)["error"] == {}


def test_reduce_refuses_duplicate_names_sparse_and_integer_gradients() -> None:
    red = reducer(rank=1, start_iter=0)
    with pytest.raises(ValueError, match="appears twice"):
        red.reduce([("w", torch.zeros(4, 4)), ("w", torch.zeros(4, 4))])
    with pytest.raises(ValueError, match="sparse"):
        red.reduce([("s", torch.zeros(4, 4).to_sparse())])
    with pytest.raises(ValueError, match="not a float"):
        red.reduce([("i", torch.zeros(4, 4, dtype=torch.int64))])
    with pytest.raises(TypeError, match="Compression.powersgd"):
        PowerSGDReducer(Compression.fp16)  # type: ignore[arg-type]


def test_torch_collectives_refuse_the_spec_before_sending() -> None:
    # compress() runs before anything is submitted, so no hora.init() is needed to see the refusal
    import hora.torch as hvd

    spec = hvd.Compression.powersgd(rank=4)
    for call in (lambda: hvd.allreduce(torch.ones(3), compression=spec),
                 lambda: hvd.grouped_allreduce([torch.ones(3)], compression=spec),
                 lambda: hvd.reducescatter(torch.ones(4), compression=spec)):
        with pytest.raises(UnsupportedOperationError, match="hora.torch.DistributedOptimizer"):
            call()


# ---- one 2-rank job -----------------------------------------------------------------------------

REF_SHAPES = [("a.bias", (7,)), ("a.weight", (20, 12)), ("conv.weight", (16, 4, 3, 3)), ("small.weight", (4, 4)),
              ("scale", ())]
REF_OPTIONS = dict(rank=2, start_iter=1)
REF_STEPS = 4
EF_STEPS = 60


def _ref_grads(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {name: torch.randn(shape, generator=g) for name, shape in REF_SHAPES}


def _ef_grad(step: int, rank: int) -> torch.Tensor:
    # a fixed full-rank matrix per rank plus noise: rank 2 cannot carry it in one step
    base = torch.randn(16, 12, generator=torch.Generator().manual_seed(50 + rank))
    return base + 0.1 * torch.randn(16, 12, generator=torch.Generator().manual_seed(10_000 + 100 * step + rank))


def _job() -> list:
    import hora.torch as hvd

    r = hvd.rank()

    def reference():
        red = PowerSGDReducer(Compression.powersgd(**REF_OPTIONS), name="psgd.ref")
        outputs = []
        for step in range(REF_STEPS):
            grads = _ref_grads(step, r)
            red.reduce(list(grads.items()))
            outputs.append(grads)
        return {"outputs": outputs, "error": red.state_dict()["error"], "sent": red.last_sent}

    def error_feedback():
        out = {}
        for ef in (True, False):
            red = PowerSGDReducer(Compression.powersgd(rank=2, start_iter=0, use_error_feedback=ef),
                                  name=f"psgd.ef.{ef}")
            total_in, total_out, half = torch.zeros(16, 12), torch.zeros(16, 12), None
            for step in range(EF_STEPS):
                grad = _ef_grad(step, r)
                total_in += grad
                red.reduce([("w", grad)])
                total_out += grad
                if step == EF_STEPS // 2 - 1:
                    half = total_out.clone()
            out[ef] = {"in": total_in, "out": total_out, "half_out": half,
                       "error": red.state_dict()["error"].get("w")}
        return out

    def checkpoint_resume():
        options = dict(rank=1, start_iter=2)
        whole = PowerSGDReducer(Compression.powersgd(**options), name="psgd.ckpt.whole")
        wanted = []
        for step in range(6):
            grads = _ref_grads(step + 10, r)
            whole.reduce(list(grads.items()))
            wanted.append(grads)
        first = PowerSGDReducer(Compression.powersgd(**options), name="psgd.ckpt.first")
        for step in range(3):
            first.reduce(list(_ref_grads(step + 10, r).items()))
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)  # each rank its own: the residuals are per rank
        del first
        buffer.seek(0)
        resumed = PowerSGDReducer(Compression.powersgd(**options), name="psgd.ckpt.resumed")
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        got = []
        for step in range(3, 6):
            grads = _ref_grads(step + 10, r)
            resumed.reduce(list(grads.items()))
            got.append(grads)
        return {"wanted": wanted[3:], "got": got}

    def rank0_state_everywhere():
        # every rank loads rank 0's state (as after broadcast_optimizer_state): rank 1 drops the
        # residuals that are not its own, and the next step still gives every rank the same result
        red = PowerSGDReducer(Compression.powersgd(rank=2, start_iter=0), name="psgd.bcast")
        for step in range(2):
            red.reduce(list(_ref_grads(step + 20, r).items()))
        state = hvd.broadcast_object(red.state_dict(), root_rank=0)
        red.load_state_dict(state)
        kept = sorted(red.state_dict()["error"])
        grads = _ref_grads(22, r)
        red.reduce(list(grads.items()))
        return {"kept": kept, "grads": grads}

    def resnet18_bytes():
        red = PowerSGDReducer(Compression.powersgd(rank=4, start_iter=1), name="psgd.r18")
        g = torch.Generator().manual_seed(r)
        sent = []
        for _ in range(2):
            red.reduce([(name, torch.randn(shape, generator=g)) for name, shape in resnet18_shapes()])
            sent.append(red.last_sent)
        return sent

    def refusal():
        spec = hvd.Compression.powersgd(rank=4)
        messages = []
        for call in (lambda: hvd.allreduce(torch.ones(3), compression=spec, name="psgd.refused"),
                     lambda: hvd.grouped_allreduce([torch.ones(3)], compression=spec, name="psgd.refused.g")):
            try:
                call()
                messages.append(None)
            except UnsupportedOperationError as exc:
                messages.append(str(exc))
        after = hvd.allreduce(torch.full((3,), float(r)), name="psgd.after.refusal")  # nothing left in flight
        return {"messages": messages, "after": after}

    def optimizer_matches_the_reducer():
        # DistributedOptimizer(compression=powersgd) hands the step's gradients to one reducer at
        # synchronize(): a standalone reducer fed copies of the same gradients must agree exactly,
        # through the warm-up (plain averaging) and the compressed steps.
        model = _psgd_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.powersgd(rank=2, start_iter=2))
        twin = PowerSGDReducer(Compression.powersgd(rank=2, start_iter=2), name="psgd.opt.twin")
        mismatch, compressed_steps = 0.0, 0
        for step in range(5):
            opt.zero_grad()
            _psgd_loss(model, step, r).backward()
            copies = [(n, p.grad.detach().clone()) for n, p in model.named_parameters()]
            opt.synchronize()
            twin.reduce(copies)
            compressed_steps += twin.last_sent.p > 0
            for (_, want), p in zip(copies, model.parameters()):
                mismatch = max(mismatch, (p.grad - want).abs().max().item())
            with opt.skip_synchronize():
                opt.step()
        return {"mismatch": mismatch, "compressed_steps": compressed_steps,
                "weights": [p.detach().clone() for p in model.parameters()],
                "state_keys": sorted(opt.state_dict()), "reducer_step": opt.state_dict()["hora_powersgd"]["step"]}

    def optimizer_checkpoint_resume():
        # state_dict() carries the reducer (residuals, Q, step): a run stopped after 3 steps and resumed
        # from its checkpoint (each rank its own) ends with the weights of the uninterrupted run
        def make():
            model = _psgd_model()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(),
                                           compression=hvd.Compression.powersgd(rank=1, start_iter=1))
            return model, opt

        return {"difference": resumed_difference(make, lambda model, step: _psgd_loss(model, step, r))}

    def rank0_checkpoint_broadcast():
        # Horovod's resume: rank 0 loads the checkpoint, broadcast_optimizer_state gives the others its
        # state. The reducer's step and Q must come along, or rank 1 warms up while rank 0 compresses.
        out = {}
        for kind, spec in (("powersgd", hvd.Compression.powersgd(rank=1, start_iter=2)),
                           ("topk", hvd.Compression.topk(ratio=0.25))):
            def make(kind=kind, spec=spec):
                model = _psgd_model()
                named = [(f"{kind}.{n}", p) for n, p in model.named_parameters()]
                opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                               named_parameters=named, compression=spec)
                return model, opt

            model, opt = make()
            for step in range(3):
                opt.zero_grad()
                _psgd_loss(model, step, r).backward()
                opt.step()
            saved = copy.deepcopy(opt.state_dict())
            model, opt = make()  # the resumed job: only rank 0 reads the checkpoint
            if r == 0:
                opt.load_state_dict(saved)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            state = opt.state_dict()[f"hora_{kind}"]
            shared = {"step": state["step"], "q": {k: v.tolist() for k, v in state.get("q", {}).items()}}
            agreed = hvd.allgather_object(shared, name=f"psgd.bcast.{kind}")
            grads = None
            if agreed[0] == agreed[1]:  # else the next step's collectives would differ and stall
                opt.zero_grad()
                _psgd_loss(model, 3, r).backward()
                opt.synchronize()
                grads = [p.grad.detach().clone() for p in model.parameters()]
            out[kind] = {"agreed": agreed, "grads": grads, "residuals": len(state["error"])}
        return out

    def optimizer_passes_and_refusals():
        model = _psgd_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), backward_passes_per_step=2,
                                       compression=hvd.Compression.powersgd(rank=2, start_iter=0))
        twin = PowerSGDReducer(Compression.powersgd(rank=2, start_iter=0), name="psgd.opt.passes.twin")
        opt.zero_grad()
        _psgd_loss(model, 0, r).backward()
        _psgd_loss(model, 1, r).backward()  # the second pass adds to the first, locally
        summed = [(n, p.grad.detach().clone()) for n, p in model.named_parameters()]
        opt.synchronize()
        twin.reduce(summed)
        mismatch = max((p.grad - want).abs().max().item() for (_, want), p in zip(summed, model.parameters()))
        # a third pass before the step is one too many (autograd has already added it when the hook
        # says so, so this model's gradients are spoilt: it is the last thing done with it)
        opt.zero_grad()
        third = None
        try:
            for step in range(3):
                _psgd_loss(model, step, r).backward()
        except AssertionError as exc:
            third = str(exc)
        refused = {}
        for label, kwargs in (("sum", {"op": hvd.Sum}), ("adasum", {"op": hvd.Adasum}),
                              ("predivide", {"gradient_predivide_factor": 2.0}), ("groups", {"num_groups": 2})):
            try:
                hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.powersgd(rank=2), **kwargs)
                refused[label] = None
            except ValueError as exc:
                refused[label] = str(exc)
        return {"mismatch": mismatch, "third": third, "refused": refused}

    return [("reference", reference), ("error_feedback", error_feedback), ("checkpoint_resume", checkpoint_resume),
            ("rank0_state_everywhere", rank0_state_everywhere), ("resnet18_bytes", resnet18_bytes),
            ("refusal", refusal), ("optimizer_matches_the_reducer", optimizer_matches_the_reducer),
            ("optimizer_checkpoint_resume", optimizer_checkpoint_resume),
            ("rank0_checkpoint_broadcast", rank0_checkpoint_broadcast),
            ("optimizer_passes_and_refusals", optimizer_passes_and_refusals)]


def _psgd_model():
    """Two matrices worth compressing at rank 1-2 (and their biases, sent plainly), alike on every rank."""
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _psgd_loss(model, step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
    x, y = torch.randn(12, 24, generator=g), torch.randn(12, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


JOB = SharedJob(_job, np=2)  # one 2-rank job for every hora.torch module


@pytest.fixture(scope="module")
def job(request) -> JobResults:
    return JOB.results(request)


def _numpy_powersgd(inputs: list[list[dict[str, torch.Tensor]]], rank: int, start_iter: int,
                    min_rate: float = 2.0) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """The algorithm again, in float64 NumPy with a library QR, from every rank's gradients: each
    step's averaged gradients, and each rank's residuals at the end."""
    size, steps = len(inputs), len(inputs[0])
    errors: list[dict[str, np.ndarray]] = [{} for _ in range(size)]
    qs: dict[str, np.ndarray] = {}
    results = []
    for step in range(steps):
        out = {}
        for name, shape in REF_SHAPES:
            grads = [inputs[k][step][name].double().numpy() for k in range(size)]
            plan = compressed_shape(shape, rank, min_rate)
            if step < start_iter or plan is None:
                out[name] = np.mean(grads, axis=0)
                continue
            n, m, r = plan
            ms = [g.reshape(n, m) + errors[k].get(name, 0.0) for k, g in enumerate(grads)]
            q = qs.get(name)
            if q is None:
                q = initial_q(name, m, r, 0).double().numpy()
            p = np.mean([mk @ q for mk in ms], axis=0)
            p, _ = np.linalg.qr(p)  # column signs may differ from Gram-Schmidt: P P^T does not
            q = np.mean([mk.T @ p for mk in ms], axis=0)
            qs[name] = q
            approx = p @ q.T
            for k in range(size):
                errors[k][name] = ms[k] - approx
            out[name] = approx.reshape(shape)
        results.append(out)
    return results, errors


def test_results_equal_a_numpy_recomputation_from_both_ranks_gradients(job: JobResults) -> None:
    ranks = job.all("reference")
    inputs = [[_ref_grads(step, k) for step in range(REF_STEPS)] for k in range(job.size)]
    expected, residuals = _numpy_powersgd(inputs, REF_OPTIONS["rank"], REF_OPTIONS["start_iter"])
    for k, got in enumerate(ranks):
        for step in range(REF_STEPS):
            for name, _ in REF_SHAPES:
                np.testing.assert_allclose(got["outputs"][step][name].double().numpy(), expected[step][name],
                                           rtol=1e-4, atol=1e-5, err_msg=f"rank {k} step {step} {name}")
    compressed = {name for name, shape in REF_SHAPES if compressed_shape(shape, REF_OPTIONS["rank"], 2.0)}
    assert compressed == {"a.weight", "conv.weight"}
    for k, got in enumerate(ranks):  # residual: this rank's M minus the shared approximation
        assert set(got["error"]) == compressed
        for name in compressed:
            np.testing.assert_allclose(got["error"][name].double().numpy(), residuals[k][name], rtol=1e-4, atol=1e-5,
                                       err_msg=f"rank {k} residual {name}")
    sent = ranks[0]["sent"]
    assert (sent.p, sent.q, sent.plain) == ((20 + 16) * 2, (12 + 36) * 2, 7 + 16 + 1)


def test_every_rank_ends_with_identical_gradients(job: JobResults) -> None:
    a, b = job.all("reference")
    for step in range(REF_STEPS):
        for name, _ in REF_SHAPES:
            assert torch.equal(a["outputs"][step][name], b["outputs"][step][name]), (step, name)
    first, second = job.all("rank0_state_everywhere")
    assert first["kept"] == ["a.weight", "conv.weight"] and second["kept"] == []
    for name, _ in REF_SHAPES:
        assert torch.equal(first["grads"][name], second["grads"][name]), name


def test_error_feedback_makes_the_sum_of_approximations_track_the_sum_of_averages(job: JobResults) -> None:
    ranks = job.all("error_feedback")
    for ef in (True, False):
        outs = [got[ef]["out"] for got in ranks]
        assert torch.equal(outs[0], outs[1])
    average = sum(got[True]["in"] for got in ranks) / job.size
    with_ef, without = ranks[0][True]["out"], ranks[0][False]["out"]

    def off(total):
        return float((total - average).norm() / average.norm())

    # what error feedback withholds is exactly the ranks' mean residual, which stays bounded
    residual = sum(got[True]["error"] for got in ranks) / job.size
    torch.testing.assert_close(with_ef + residual, average, rtol=1e-4, atol=1e-3)
    assert off(with_ef) < 0.1, off(with_ef)
    assert off(without) > 0.4, off(without)  # without it, rank 2 keeps missing the same directions
    half_average = sum(sum(_ef_grad(s, k) for s in range(EF_STEPS // 2)) for k in range(job.size)) / job.size
    half_off = float((ranks[0][True]["half_out"] - half_average).norm() / half_average.norm())
    assert off(with_ef) < 0.75 * half_off, (off(with_ef), half_off)  # the gap shrinks as steps add up


def test_checkpoint_resumed_mid_run_gives_identical_gradients(job: JobResults) -> None:
    for got in job.all("checkpoint_resume"):
        for wanted, resumed in zip(got["wanted"], got["got"]):
            for name in wanted:
                assert torch.equal(wanted[name], resumed[name]), name


def test_resnet18_at_rank_4_sends_under_a_twentieth_of_plain_allreduce(job: JobResults) -> None:
    for warmup, compressed in job.all("resnet18_bytes"):
        assert warmup.sent == warmup.uncompressed == RESNET18_PARAMETERS
        assert compressed.uncompressed == RESNET18_PARAMETERS
        assert compressed.sent * 20 <= compressed.uncompressed, compressed
        assert compressed.sent_bytes * 20 <= compressed.uncompressed_bytes


def test_plain_collectives_refuse_powersgd_on_every_rank_and_leave_nothing_in_flight(job: JobResults) -> None:
    for got in job.all("refusal"):
        assert all(m is not None and "hora.torch.DistributedOptimizer" in m and "\n" not in m
                   for m in got["messages"]), got["messages"]
        torch.testing.assert_close(got["after"], torch.full((3,), 0.5))


def test_distributed_optimizer_with_powersgd_reduces_as_the_reducer_does_2ranks(job: JobResults) -> None:
    for rank in range(2):
        got = job.get("optimizer_matches_the_reducer", rank)
        assert got["mismatch"] == 0.0 and got["compressed_steps"] == 3, got
        assert "hora_powersgd" in got["state_keys"] and got["reducer_step"] == 5
    first, second = (job.get("optimizer_matches_the_reducer", rank)["weights"] for rank in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))  # every rank applied the same update


def test_distributed_optimizer_with_powersgd_resumes_from_its_checkpoint_exactly_2ranks(job: JobResults) -> None:
    for rank in range(2):
        assert job.get("optimizer_checkpoint_resume", rank)["difference"] == 0.0


@pytest.mark.parametrize("kind", ["powersgd", "topk"])
def test_broadcast_optimizer_state_gives_every_rank_the_roots_reducer_step_and_q_2ranks(
        job: JobResults, kind: str) -> None:
    """Horovod's resume (rank 0 loads the checkpoint, then broadcast_optimizer_state): every rank then
    reduces in step with the root, and rank 1 keeps no residual it does not own."""
    first, second = (job.get("rank0_checkpoint_broadcast", rank)[kind] for rank in range(2))
    assert first["agreed"][0] == first["agreed"][1], first["agreed"]
    assert first["agreed"][0]["step"] == 3
    if kind == "powersgd":
        assert first["agreed"][0]["q"], first["agreed"]
    assert all(torch.equal(a, b) for a, b in zip(first["grads"], second["grads"]))
    assert second["residuals"] == 0


def test_distributed_optimizer_with_powersgd_accumulates_passes_and_refuses_what_it_cannot_do_2ranks(
        job: JobResults) -> None:
    got = job.get("optimizer_passes_and_refusals", 0)
    assert got["mismatch"] == 0.0
    assert got["third"] is not None and "backward_passes_per_step" in got["third"]
    for label, message in got["refused"].items():
        assert message is not None and "Compression.powersgd" in message, (label, message)
