"""hora.torch.topk: top-k sparsification with error feedback, checked two ways.

Without processes, through a one-rank communicator: the size rule, what one rank sends and keeps,
the state's round trip, and the refusals outside hora.torch.DistributedOptimizer. In the 2-rank job
every hora.torch module shares: the results against a float64 NumPy re-computation from both ranks'
gradients, identical gradients on every rank, error feedback's exact bookkeeping over many steps,
DistributedOptimizer against a standalone reducer, a checkpoint resumed mid-run, and the bytes sent
for a ResNet-18-shaped parameter list.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from compression_helpers import RESNET18_PARAMETERS, OneRank, resnet18_shapes, resumed_difference  # noqa: E402
from sections import JobResults, SharedJob  # noqa: E402

from hora.compression import Compression  # noqa: E402
from hora.errors import UnsupportedOperationError  # noqa: E402
from hora.torch.topk import TopKReducer, sparse_count  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the first test runs every module's share of the job


def reducer(comm=None, **options) -> TopKReducer:
    return TopKReducer(Compression.topk(**options), communicator=comm or OneRank())


# ---- without processes --------------------------------------------------------------------------


@pytest.mark.parametrize("numel, dtype, ratio, expected", [
    (10_000, torch.float32, 0.01, 100),
    (3, torch.float32, 0.01, None),  # 1 value + 1 index, twice, is more than 3 floats
    (10, torch.float32, 0.01, 1),
    (1000, torch.float64, 0.5, None),  # half the elements with their indices cost more than all of them
    (1000, torch.float16, 0.1, 100),  # half precision is selected and sent as float32
])
def test_size_rule(numel, dtype, ratio, expected) -> None:
    assert sparse_count(numel, dtype, Compression.topk(ratio=ratio)) == expected


def test_one_rank_sends_its_largest_elements_and_keeps_the_rest_for_the_next_step() -> None:
    comm = OneRank()
    red = reducer(comm, ratio=0.25, min_compression_rate=0)  # sparsify even 8 elements
    first = torch.tensor([[0.1, -4.0, 0.3, 2.0], [-0.2, 0.5, 3.0, -0.05]])
    grad = first.clone()
    sent = red.reduce([("w", grad)])
    torch.testing.assert_close(grad, torch.tensor([[0.0, -4.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]]))
    residual = red.state_dict()["error"]["w"]
    torch.testing.assert_close(residual.view(2, 4), first - grad)
    assert (sent.values, sent.indices, sent.plain) == (2, 2, 0)
    assert comm.calls == [("topk.sparse", 4)]
    # the next step: the residual joins the new gradient, so 2.0 (held back) now leads
    grad2 = torch.zeros(2, 4)
    red.reduce([("w", grad2)])
    torch.testing.assert_close(grad2, torch.tensor([[0.0, 0.0, 0.0, 2.0], [0.0, 0.5, 0.0, 0.0]]))


def test_without_error_feedback_nothing_is_kept() -> None:
    red = reducer(ratio=0.25, use_error_feedback=False, min_compression_rate=0)
    grad = torch.arange(1.0, 9.0)
    red.reduce([("w", grad)])
    torch.testing.assert_close(grad, torch.tensor([0.0, 0, 0, 0, 0, 0, 7, 8]))
    assert red.state_dict()["error"] == {}


def test_half_precision_gradients_keep_a_float32_residual() -> None:
    red = reducer(ratio=0.1)
    grad = torch.linspace(-1, 1, 100, dtype=torch.bfloat16)
    red.reduce([("w", grad)])
    assert grad.dtype == torch.bfloat16
    assert red.state_dict()["error"]["w"].dtype == torch.float32


def test_small_gradients_go_through_one_plain_average() -> None:
    comm = OneRank()
    red = reducer(comm, ratio=0.01)
    red.reduce([("bias", torch.ones(3)), ("w", torch.ones(400)), ("scale", torch.ones(()))])
    assert comm.calls == [("topk.plain", 4), ("topk.sparse", 8)]


def test_state_dict_round_trip_resumes_exactly_and_another_worlds_residuals_are_dropped() -> None:
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(50, generator=g) for _ in range(4)]
    whole = reducer(ratio=0.1)
    wanted = []
    for grad in grads:
        out = grad.clone()
        whole.reduce([("w", out)])
        wanted.append(out)
    first = reducer(ratio=0.1)
    for grad in grads[:2]:
        first.reduce([("w", grad.clone())])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = reducer(ratio=0.1)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.step == 2
    for grad, want in zip(grads[2:], wanted[2:]):
        out = grad.clone()
        resumed.reduce([("w", out)])
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    other_rank = reducer(OneRank(rank=1, size=2), ratio=0.1)
    other_rank.load_state_dict(first.state_dict())
    assert other_rank.state_dict()["error"] == {} and other_rank.step == 2


def test_reduce_refuses_duplicate_names_sparse_and_integer_gradients() -> None:
    red = reducer()
    for entries, match in (([("a", torch.ones(2)), ("a", torch.ones(2))], "twice"),
                           ([("a", torch.ones(2).to_sparse())], "sparse"),
                           ([("a", torch.ones(2, dtype=torch.int64))], "not a float")):
        with pytest.raises(ValueError, match=match):
            red.reduce(entries)


def test_the_spec_is_refused_outside_the_torch_optimizer_and_checked_when_made() -> None:
    from hora.horovod_args import check_compression

    spec = Compression.topk(ratio=0.05)
    with pytest.raises(UnsupportedOperationError, match=r"Compression.topk\(ratio=0.05\) cannot run in a plain"):
        spec.compress(torch.ones(3))
    with pytest.raises(UnsupportedOperationError, match="error-feedback residual"):
        check_compression(spec)  # every wrapper but hora.torch.DistributedOptimizer
    assert check_compression(spec, stateful=True) is spec
    with pytest.raises(TypeError, match="must be called"):
        check_compression(Compression.topk)
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="ratio"):
            Compression.topk(ratio=bad)


# ---- the 2-rank job every hora.torch module shares ---------------------------------------------

REF_SHAPES = [("a.bias", (7,)), ("a.weight", (20, 12)), ("conv.weight", (16, 4, 3, 3)), ("tiny", (2,))]
REF_RATIO = 0.1
REF_STEPS = 4
EF_STEPS = 40


def _ref_grads(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 * step + rank)
    return {name: torch.randn(shape, generator=g) for name, shape in REF_SHAPES}


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _loss(model, step: int, rank: int):
    g = torch.Generator().manual_seed(200 * step + rank)
    x, y = torch.randn(12, 24, generator=g), torch.randn(12, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def _job() -> list:
    import hora.torch as hvd

    r = hvd.rank()

    def reference():
        red = TopKReducer(Compression.topk(ratio=REF_RATIO), name="topk.ref")
        outputs = []
        for step in range(REF_STEPS):
            grads = _ref_grads(step, r)
            red.reduce(list(grads.items()))
            outputs.append(grads)
        return {"outputs": outputs, "sent": red.last_sent}

    def error_feedback():
        red = TopKReducer(Compression.topk(ratio=0.05), name="topk.ef")
        total_in, total_out = torch.zeros(30, 20, dtype=torch.float64), torch.zeros(30, 20, dtype=torch.float64)
        for step in range(EF_STEPS):
            grad = torch.randn(30, 20, generator=torch.Generator().manual_seed(70_000 + 10 * step + r),
                               dtype=torch.float64)
            total_in += grad
            red.reduce([("w", grad)])
            total_out += grad
        return {"in": total_in, "out": total_out, "error": red.state_dict()["error"]["w"].view(30, 20)}

    def optimizer_matches_the_reducer():
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.topk(ratio=0.1))
        twin = TopKReducer(Compression.topk(ratio=0.1), name="topk.opt.twin")
        mismatch = 0.0
        for step in range(4):
            opt.zero_grad()
            _loss(model, step, r).backward()
            copies = [(n, p.grad.detach().clone()) for n, p in model.named_parameters()]
            opt.synchronize()
            twin.reduce(copies)
            for (_, want), p in zip(copies, model.parameters()):
                mismatch = max(mismatch, (p.grad - want).abs().max().item())
            with opt.skip_synchronize():
                opt.step()
        state = opt.state_dict()
        return {"mismatch": mismatch, "weights": [p.detach().clone() for p in model.parameters()],
                "reducer_step": state["hora_topk"]["step"], "residuals": sorted(state["hora_topk"]["error"])}

    def optimizer_checkpoint_resume():
        def make():
            model = _model()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(),
                                           compression=hvd.Compression.topk(ratio=0.05))
            return model, opt

        model, opt = make()  # the weights do move under top-k (a zero difference below means something)
        opt.zero_grad()
        _loss(model, 0, r).backward()
        opt.step()
        moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), _model().parameters()))
        return {"difference": resumed_difference(make, lambda model, step: _loss(model, step, r)), "moved": moved}

    def resnet18_bytes():
        red = TopKReducer(Compression.topk(ratio=0.01), name="topk.r18")
        g = torch.Generator().manual_seed(r)
        red.reduce([(name, torch.randn(shape, generator=g)) for name, shape in resnet18_shapes()])
        return red.last_sent

    def refusals():
        model = _model()
        refused = {}
        for label, kwargs in (("sum", {"op": hvd.Sum}), ("adasum", {"op": hvd.Adasum}),
                              ("predivide", {"gradient_predivide_factor": 2.0}), ("groups", {"num_groups": 2}),
                              ("sharded", {"shard_optimizer_state": True})):
            try:
                hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.topk(), **kwargs)
                refused[label] = None
            except ValueError as exc:
                refused[label] = str(exc)
        try:
            hvd.allreduce(torch.ones(3), compression=hvd.Compression.topk(), name="topk.refused")
            plain = None
        except UnsupportedOperationError as exc:
            plain = str(exc)
        after = hvd.allreduce(torch.full((3,), float(r)), name="topk.after.refusal")  # nothing left in flight
        return {"refused": refused, "plain": plain, "after": after}

    return [("reference", reference), ("error_feedback", error_feedback),
            ("optimizer_matches_the_reducer", optimizer_matches_the_reducer),
            ("optimizer_checkpoint_resume", optimizer_checkpoint_resume), ("resnet18_bytes", resnet18_bytes),
            ("refusals", refusals)]


JOB = SharedJob(_job, np=2)  # joins the one 2-rank job of every hora.torch module


@pytest.fixture(scope="module")
def job(request) -> JobResults:
    return JOB.results(request)


def _numpy_topk(inputs: list[list[dict[str, torch.Tensor]]], ratio: float) -> list[dict[str, np.ndarray]]:
    """The algorithm again in float64 NumPy, from every rank's gradients: each step's average."""
    size, steps = len(inputs), len(inputs[0])
    errors: list[dict[str, np.ndarray]] = [{} for _ in range(size)]
    results = []
    spec = Compression.topk(ratio=ratio)
    for step in range(steps):
        out = {}
        for name, shape in REF_SHAPES:
            grads = [inputs[k][step][name].double().numpy().reshape(-1) for k in range(size)]
            k_count = sparse_count(math.prod(shape), torch.float32, spec)
            if k_count is None:
                out[name] = np.mean(grads, axis=0).reshape(shape)
                continue
            total = np.zeros(math.prod(shape))
            for k in range(size):
                acc = grads[k] + errors[k].get(name, 0.0)
                top = np.argsort(-np.abs(acc), kind="stable")[:k_count]
                total[top] += acc[top]
                kept = acc.copy()
                kept[top] = 0.0
                errors[k][name] = kept
            out[name] = (total / size).reshape(shape)
        results.append(out)
    return results


def test_results_equal_a_numpy_recomputation_from_both_ranks_gradients(job: JobResults) -> None:
    inputs = [[_ref_grads(step, k) for step in range(REF_STEPS)] for k in range(job.size)]
    wanted = _numpy_topk(inputs, REF_RATIO)
    got = job.get("reference", 0)["outputs"]
    for step in range(REF_STEPS):
        for name, _ in REF_SHAPES:
            np.testing.assert_allclose(got[step][name].double().numpy(), wanted[step][name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step} {name}")


def test_every_rank_ends_with_identical_gradients(job: JobResults) -> None:
    ranks = job.all("reference")
    for step in range(REF_STEPS):
        for name, _ in REF_SHAPES:
            for other in ranks[1:]:
                assert torch.equal(ranks[0]["outputs"][step][name], other["outputs"][step][name]), (step, name)


def test_error_feedback_delivers_every_contribution_but_the_last_residuals(job: JobResults) -> None:
    """Each rank sent its gradients' sum less its final residual, so the sum of the averaged outputs
    is the average of the ranks' inputs less the average final residual: nothing is lost, only late."""
    ranks = job.all("error_feedback")
    mean_in = sum(r["in"] for r in ranks) / len(ranks)
    mean_error = sum(r["error"] for r in ranks) / len(ranks)
    assert mean_error.abs().max() > 0  # something was held back at the end
    for got in ranks:
        torch.testing.assert_close(got["out"], mean_in - mean_error, rtol=1e-9, atol=1e-9)


def test_distributed_optimizer_with_topk_reduces_as_the_reducer_does_2ranks(job: JobResults) -> None:
    ranks = job.all("optimizer_matches_the_reducer")
    for got in ranks:
        assert got["mismatch"] == 0.0
        assert got["reducer_step"] == 4 and got["residuals"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(a, b)


def test_distributed_optimizer_with_topk_resumes_from_its_checkpoint_exactly_2ranks(job: JobResults) -> None:
    for got in job.all("optimizer_checkpoint_resume"):
        assert got["difference"] == 0.0 and got["moved"] > 0


def test_resnet18_at_one_percent_sends_a_thirtieth_of_plain_allreduce(job: JobResults) -> None:
    sent = job.get("resnet18_bytes", 0)
    # 1% of the elements (at least one per tensor) as float32 values with int64 positions: 3% of the bytes
    assert sent.ratio < 1 / 30, sent
    assert sent.uncompressed == RESNET18_PARAMETERS


def test_what_topk_cannot_do_is_refused_when_the_optimizer_is_built_2ranks(job: JobResults) -> None:
    got = job.get("refusals", 0)
    for label, message in got["refused"].items():
        assert message is not None and "Compression.topk" in message, (label, message)
    assert got["plain"] is not None and "cannot run in a plain collective" in got["plain"]
    torch.testing.assert_close(got["after"], torch.full((3,), 0.5))
