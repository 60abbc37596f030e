"""hora.torch.DistributedOptimizer(comm_hook=...): each gradient bucket goes to a hook that returns a
future of the reduced bucket (hora.torch.comm_hooks), in the 2-rank job every hora.torch module shares.

The hooks hora ships take the same steps as the optimizer without a hook (allreduce_hook as the
default, fp16_compress_hook as Compression.fp16); a user's hook sees every gradient once per step,
in buckets with names, views and one last bucket, and may return a torch.futures.Future or chain with
then(); backward_passes_per_step and sparse_as_dense work through it; what a hook cannot combine with
is refused when the optimizer is built, and a hook that returns the wrong thing fails on every rank.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sections import JobResults, SharedJob  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the first test runs every module's share of the job

STEPS = 5


def _model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _loss(model, step: int, rank: int):
    g = torch.Generator().manual_seed(500 * step + rank)
    x, y = torch.randn(6, 10, generator=g), torch.randn(6, 3, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def _job() -> list:
    import hora.torch as hvd
    from hora.torch import comm_hooks

    r = hvd.rank()

    def train(passes: int = 1, **kwargs) -> list:
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                       **kwargs)
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(passes):
                _loss(model, passes * step + micro, r).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    def shipped_hooks():
        return {"default": train(), "allreduce_hook": train(comm_hook=comm_hooks.allreduce_hook),
                "fp16": train(compression=hvd.Compression.fp16),
                "fp16_compress_hook": train(comm_hook=comm_hooks.fp16_compress_hook),
                "bf16_compress_hook": train(comm_hook=comm_hooks.bf16_compress_hook),
                "passes2.default": train(passes=2),
                "passes2.hook": train(passes=2, comm_hook=comm_hooks.allreduce_hook)}

    def users_hook():
        # Sums with a plain hora collective and divides by the set's size in a chained step; records
        # what it is shown. Small buckets: several per step, and a parameter alone in one.
        seen = []

        def hook(bucket):
            seen.append({"index": bucket.index(), "names": bucket.names(), "last": bucket.is_last(),
                         "views_share_the_buffer": all(g.untyped_storage().data_ptr()
                                                       == bucket.buffer().untyped_storage().data_ptr()
                                                       for g in bucket.gradients()),
                         "shapes_match": [tuple(g.shape) for g in bucket.gradients()]
                         == [tuple(p.shape) for p in bucket.parameters()]})
            handle = hvd.allreduce_async_(bucket.buffer(), name=bucket.name, op=hvd.Sum,
                                          process_set=bucket.process_set)
            size = bucket.process_set.size()
            return comm_hooks.HookFuture.of(handle).then(lambda future: future.value() / size)

        def torch_future_hook(bucket):
            future = torch.futures.Future()
            future.set_result(hvd.allreduce(bucket.buffer(), name=bucket.name))
            return future

        import os
        os.environ["HORA_GRADIENT_BUCKET_BYTES"] = "700"
        try:
            chained = train(comm_hook=hook)
            torch_future = train(comm_hook=torch_future_hook)
            default = train()
        finally:
            del os.environ["HORA_GRADIENT_BUCKET_BYTES"]
        return {"chained": chained, "torch_future": torch_future, "default": default, "seen": seen}

    def sparse_as_dense():
        def run(**kwargs):
            torch.manual_seed(4)
            embedding = torch.nn.Embedding(20, 4, sparse=True)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.5),
                                           named_parameters=embedding.named_parameters(), sparse_as_dense=True,
                                           **kwargs)
            for step in range(3):
                opt.zero_grad()
                embedding(torch.tensor([r + step, 5 + 2 * r])).sum().backward()
                opt.step()
            return embedding.weight.detach().clone()
        return {"hook": run(comm_hook=comm_hooks.allreduce_hook), "default": run()}

    def refusals():
        model = _model()
        out = {}
        for label, kwargs in (("sum", {"op": hvd.Sum}), ("predivide", {"gradient_predivide_factor": 2.0}),
                              ("fp16", {"compression": hvd.Compression.fp16}), ("groups", {"num_groups": 2}),
                              ("sharded", {"shard_optimizer_state": True}), ("not_callable", {"comm_hook": 3})):
            kwargs = {"comm_hook": comm_hooks.allreduce_hook, **kwargs}
            try:
                hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), **kwargs)
                out[label] = None
            except (TypeError, ValueError) as exc:
                out[label] = f"{type(exc).__name__}: {exc}"

        def wrong_size(bucket):  # the collective runs on every rank; the value is refused on every rank
            return comm_hooks.HookFuture.of(hvd.allreduce_async(bucket.buffer()[:1], name=bucket.name))

        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), comm_hook=wrong_size)
        _loss(model, 0, r).backward()
        try:
            opt.step()
            out["wrong_size"] = None
        except ValueError as exc:
            out["wrong_size"] = str(exc)
        out["after"] = hvd.allreduce(torch.full((2,), float(r)), name="hooks.after")  # nothing left in flight
        return out

    return [("shipped_hooks", shipped_hooks), ("users_hook", users_hook), ("sparse_as_dense", sparse_as_dense),
            ("refusals", refusals)]


JOB = SharedJob(_job, np=2)  # joins the one 2-rank job of every hora.torch module


@pytest.fixture(scope="module")
def job(request) -> JobResults:
    return JOB.results(request)


def _equal(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def test_allreduce_hook_takes_the_optimizers_own_steps_2ranks(job: JobResults) -> None:
    for got in job.all("shipped_hooks"):
        assert _equal(got["allreduce_hook"], got["default"])
        assert _equal(got["passes2.hook"], got["passes2.default"])
        assert not _equal(got["passes2.default"], got["default"])


def test_fp16_compress_hook_takes_compression_fp16s_steps_and_bf16_stays_close_2ranks(job: JobResults) -> None:
    for got in job.all("shipped_hooks"):
        assert _equal(got["fp16_compress_hook"], got["fp16"])
        for bf16, exact in zip(got["bf16_compress_hook"], got["default"]):
            torch.testing.assert_close(bf16, exact, rtol=2e-2, atol=2e-3)


def test_a_users_hook_sees_every_gradient_once_per_step_and_its_chained_average_is_the_average_2ranks(
        job: JobResults) -> None:
    ranks = job.all("users_hook")
    for got in ranks:
        for chained, torch_future, default in zip(got["chained"], got["torch_future"], got["default"]):
            torch.testing.assert_close(chained, default, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(torch_future, default, rtol=1e-6, atol=1e-7)
        seen = got["seen"]
        per_step = len(seen) // STEPS
        assert per_step >= 3 and len(seen) == per_step * STEPS, len(seen)
        names = [n for entry in seen[:per_step] for n in entry["names"]]
        assert sorted(names) == sorted(f"{layer}.{kind}" for layer in (0, 2, 4) for kind in ("weight", "bias"))
        assert [entry["index"] for entry in seen[:per_step]] == list(range(per_step))
        assert [entry["last"] for entry in seen[:per_step]] == [False] * (per_step - 1) + [True]
        assert any(len(entry["names"]) == 1 for entry in seen) and any(len(entry["names"]) > 1 for entry in seen)
        assert all(entry["views_share_the_buffer"] and entry["shapes_match"] for entry in seen)
    assert _equal(ranks[0]["chained"], ranks[1]["chained"])


def test_sparse_as_dense_gradients_go_through_the_hook_2ranks(job: JobResults) -> None:
    for got in job.all("sparse_as_dense"):
        assert torch.equal(got["hook"], got["default"])


def test_what_a_hook_cannot_combine_with_is_refused_and_a_wrong_value_fails_every_rank_2ranks(
        job: JobResults) -> None:
    for got in job.all("refusals"):
        for label in ("sum", "predivide", "fp16", "groups", "sharded"):
            assert got[label] is not None and got[label].startswith("ValueError: comm_hook decides"), got[label]
        assert got["not_callable"] is not None and got["not_callable"].startswith("TypeError: comm_hook must be"), got
        assert got["wrong_size"] is not None and "must give the bucket's" in got["wrong_size"], got["wrong_size"]
        torch.testing.assert_close(got["after"], torch.full((2,), 0.5))
