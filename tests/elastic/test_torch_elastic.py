"""hora.torch.elastic: ElasticSampler's sharding and resuming, TorchState's commit / restore / sync, and
an elastic torch training loop that survives a failed collective and a host change.

The sampler's arithmetic is checked in this process with the world given explicitly (a subclass
overrides the private ``_world``), for sizes a job cannot change to without the elastic driver, which
does not exist yet. TorchState and the training loop run in a real 2-rank job (shared with
test_keras_elastic.py's Keras-on-torch sections: see shared_jobs.py); its resets are ones that every
rank sees (all ranks raise HorovodInternalError at the same step, or rank 0 writes the host-update key).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sections import JobResults  # noqa: E402
from shared_jobs import Sections, announce_host_change, generation  # noqa: E402

import hora  # noqa: E402
import hora.torch as hvd  # noqa: E402
from hora.errors import HorovodInternalError  # noqa: E402
from hora.torch.elastic import ElasticSampler, TorchState, run  # noqa: E402

pytestmark = pytest.mark.timeout(240)


class WorldSampler(ElasticSampler):
    """An ElasticSampler on a world given explicitly, standing for one rank of a job of that size."""

    def __init__(self, dataset: Any, rank: int, size: int, **kwargs: Any) -> None:
        self.world = (rank, size)
        super().__init__(dataset, **kwargs)

    def _world(self) -> tuple[int, int]:
        return self.world


def _job(n: int, size: int, **kwargs: Any) -> list[WorldSampler]:
    return [WorldSampler(range(n), r, size, **kwargs) for r in range(size)]


def _move(samplers: list[ElasticSampler], size: int) -> list[WorldSampler]:
    """The samplers of a world of ``size`` ranks, each loading rank 0's state (as sync does)."""
    dataset = samplers[0].dataset
    moved = [WorldSampler(dataset, r, size, shuffle=samplers[0].shuffle, seed=samplers[0].seed)
             for r in range(size)]
    for sampler in moved:
        sampler.load_state_dict(samplers[0].state_dict())
    return moved


def _assert_partition(shards: list[list[int]], expected: set[int]) -> None:
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)), "an index is in two shards"
    assert set(flat) == expected, f"missing {sorted(expected - set(flat))}, extra {sorted(set(flat) - expected)}"


# ---- ElasticSampler, with the world given explicitly -----------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 10, 11, 64])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_shards_cover_the_dataset_exactly_once_per_epoch(n: int, size: int, shuffle: bool) -> None:
    samplers = _job(n, size, shuffle=shuffle, seed=5)
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        shards = [list(iter(s)) for s in samplers]
        _assert_partition(shards, set(range(n)))
        assert [len(s) for s in samplers] == [len(shard) for shard in shards]
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_unshuffled_shards_are_strided_index_order() -> None:
    samplers = _job(7, 3, shuffle=False)
    assert [list(s) for s in samplers] == [[0, 3, 6], [1, 4], [2, 5]]


def test_record_batch_marks_that_batch_of_every_rank_as_processed() -> None:
    samplers = _job(50, 3, seed=2)
    for sampler in samplers:
        sampler.record_batch(1, 4)
    every_rank_batch_1 = {i for s in samplers for i in s.get_indices(1, 4)}
    assert len(every_rank_batch_1) == 12
    for sampler in samplers:
        assert sampler.processed_indices == every_rank_batch_1


@pytest.mark.parametrize("old_size,new_size", [(3, 2), (2, 3), (4, 1), (1, 4), (3, 3)])
@pytest.mark.parametrize("n", [37, 60])
def test_indices_left_after_recorded_batches_are_split_over_another_world_size_with_no_duplicate_and_no_gap(
        old_size: int, new_size: int, n: int) -> None:
    samplers = _job(n, old_size, seed=9)
    batch_size = 3
    processed = set()
    for batch_idx in range(2):  # two steps of the data-parallel loop on every rank
        for sampler in samplers:
            processed.update(sampler.get_indices(batch_idx, batch_size))
            sampler.record_batch(batch_idx, batch_size)
    assert all(s.processed_indices == processed for s in samplers)

    moved = _move(samplers, new_size)
    shards = [list(s) for s in moved]
    _assert_partition(shards, set(range(n)) - processed)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_an_epoch_resharded_twice_processes_every_index_exactly_once() -> None:
    """3 ranks, then 2, then 4, with steps processed but not recorded (rolled back) in between."""
    n, batch_size = 101, 4
    samplers = _job(n, 3, seed=3)
    for sampler in samplers:
        sampler.set_epoch(2)
    processed: list[int] = []
    for size, steps in ((3, 3), (2, 5), (4, None)):
        if size != len(samplers):
            samplers = _move(samplers, size)
        batches = [[s.get_indices(b, batch_size) for b in range((len(s) + batch_size - 1) // batch_size)]
                   for s in samplers]
        # A DataLoader over the sampler gives the same batches as get_indices.
        loaded = [[b.tolist() for b in torch.utils.data.DataLoader(range(n), batch_size=batch_size, sampler=s)]
                  for s in samplers]
        assert loaded == batches
        last = max(map(len, batches)) if steps is None else steps
        for b in range(last):
            for rank, sampler in enumerate(samplers):
                processed.extend(batches[rank][b] if b < len(batches[rank]) else [])
                sampler.record_batch(b, batch_size)
    assert sorted(processed) == list(range(n))
    assert samplers[0].processed_indices == set(range(n))
    assert all(len(s) == 0 for s in _move(samplers, 2))


def test_state_dict_round_trip_gives_the_same_epoch_and_shards() -> None:
    source = WorldSampler(range(40), 1, 2, seed=4)
    source.set_epoch(3)
    source.record_batch(0, 5)
    source.record_indices([39, 38])
    state = source.state_dict()
    assert state == {"epoch": 3, "processed_indices": source.processed_indices}
    state["processed_indices"].add(-1)  # the dict is a copy: changing it leaves the sampler alone
    assert -1 not in source.processed_indices
    state["processed_indices"].discard(-1)

    target = WorldSampler(range(40), 1, 2, seed=4)
    target.load_state_dict(state)
    assert target.epoch == 3 and target.processed_indices == source.processed_indices
    source.reset()
    assert list(target) == list(source)
    # A list of indices (what a state saved as JSON holds) loads too.
    target.load_state_dict({"epoch": 3, "processed_indices": sorted(state["processed_indices"])})
    assert list(target) == list(source)


def test_set_epoch_reshuffles_deterministically_and_forgets_processed_indices() -> None:
    a, b = WorldSampler(range(30), 0, 1, seed=7), WorldSampler(range(30), 0, 1, seed=7)
    orders = []
    for epoch in (0, 1, 2):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b)
        orders.append(list(a))
    assert len({tuple(o) for o in orders}) == 3
    assert list(WorldSampler(range(30), 0, 1, seed=8)) != orders[0]

    a.record_batch(0, 10)
    assert len(a.processed_indices) == 10
    a.set_epoch(1)
    assert a.processed_indices == set() and list(a) == orders[1]


def test_the_order_of_an_epoch_survives_a_reset() -> None:
    """What remains keeps the epoch's order: a reset only drops what was processed."""
    sampler = WorldSampler(range(20), 0, 1, seed=1)
    order = list(sampler)
    sampler.record_batch(0, 6)
    sampler.reset()
    assert list(sampler) == order[6:]


def test_sampler_needs_hora_initialised(uninitialised: None) -> None:
    with pytest.raises(ValueError):
        ElasticSampler(range(4))


# ---- TorchState and the elastic loop, in a real 2-rank job -------------------------------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def _snapshot(state: TorchState) -> dict[str, Any]:
    """Everything TorchState keeps, as plain comparable values."""
    optimizer = state.optimizer.state_dict()
    return {
        "model": {k: v.tolist() for k, v in state.model.state_dict().items()},
        "optimizer_state": {p: {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in s.items()}
                            for p, s in optimizer["state"].items()},
        "lr": [g["lr"] for g in state.optimizer.param_groups],
        "scheduler": {k: v for k, v in state.scheduler.state_dict().items() if k != "_get_lr_called_within_step"},
        "sampler": state.sampler.state_dict(),
        "epoch": state.epoch,
        "history": list(state.history),
    }


def _new_state(seed: int) -> TorchState:
    model = _model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (seed + 1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    sampler = ElasticSampler(range(40), seed=3)
    return TorchState(model, optimizer, scheduler=scheduler, sampler=sampler, epoch=0, history=[seed])


def state_and_training_sections() -> Sections:
    """This module's sections of tests/elastic/conftest.py's ``torch_job``."""
    return _state_sections() + [("training", _elastic_training)]


def _state_sections() -> Sections:
    rank = hora.rank()
    state = _new_state(seed=rank)  # every rank starts different: sync must make them equal

    def restore() -> dict[str, Any]:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
        _train_step(state.model, state.optimizer, x)
        state.scheduler.step()
        state.sampler.record_batch(0, 4)
        state.epoch, state.history = 1, state.history + [1]
        state.commit()
        committed = _snapshot(state)
        changes = []
        for _ in range(2):  # restore twice: the first restore must not let later steps alter the commit
            for _ in range(3):
                _train_step(state.model, state.optimizer, x)
                state.scheduler.step()
            state.sampler.set_epoch(5)
            state.epoch = 7
            state.history.append(99)
            changes.append(_snapshot(state) != committed)
            state.restore()
            assert _snapshot(state) == committed
        return {"changed": changes, "restored": _snapshot(state) == committed,
                "shard": list(state.sampler)}

    def sync() -> dict[str, Any]:
        state.sampler.record_indices([30 + rank])  # one rank's own record: sync unites them
        state.commit()
        state.sync()
        return {"snapshot": _snapshot(state), "shard": list(state.sampler)}

    def follows_reassigned_model() -> list[float]:
        state.model = _model(seed=10 + rank)
        state.sync()
        return [p.sum().item() for p in state.model.parameters()]

    return [("restore", restore), ("sync", sync), ("reassigned", follows_reassigned_model),
            ("partial_commit", _partial_commit)]


def _partial_commit() -> dict[str, Any]:
    """A sharded optimizer's commit that completed on rank 1 and not on rank 0, as a rank lost during
    the commit's exchange can leave it: emulated by putting back what rank 0 kept at the commit before
    (its model and its shard). The re-formed world takes rank 0's model, so every rank must load the
    optimizer state of that same commit, rank 1 included, though rank 1 kept a newer one."""
    import copy

    rank = hora.rank()
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                         named_parameters=[(f"partial.{n}", p) for n, p in model.named_parameters()],
                                         shard_optimizer_state=True)
    state = TorchState(model, optimizer)
    handlers = {h.name: h for h in state._handlers}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))

    def whole_state() -> dict[str, Any]:
        optimizer.consolidate_state_dict(0)
        if rank != 0:
            return {}
        return {p: {k: v.tolist() for k, v in s.items()} for p, s in optimizer.state_dict()["state"].items()}

    # The first commit, done on rank 1 only: every rank goes back to the state it was built with.
    built = (handlers["optimizer"].saved, copy.deepcopy(handlers["model"].saved))
    _train_step(model, optimizer, x)
    state.commit()
    if rank == 0:
        handlers["optimizer"].saved, handlers["model"].saved = built
    state.restore()
    state.sync()
    at_build = whole_state()

    _train_step(model, optimizer, x)
    state.commit()
    at_first = whole_state()
    first = (handlers["optimizer"].saved, copy.deepcopy(handlers["model"].saved))
    _train_step(model, optimizer, x)
    state.commit()
    at_second = whole_state()
    if rank == 0:
        handlers["optimizer"].saved, handlers["model"].saved = first
    _train_step(model, optimizer, x)  # not committed: rolled back
    state.restore()
    state.sync()
    return {"restored": whole_state(), "first": at_first, "second": at_second, "at_build": at_build}


def test_restore_gives_back_the_committed_model_optimizer_scheduler_sampler_and_attributes(
        torch_job: JobResults) -> None:
    for rank in (0, 1):
        result = torch_job.get("restore", rank)
        assert result["changed"] == [True, True]
        assert result["restored"]


def test_sync_gives_every_rank_rank_0s_model_optimizer_scheduler_and_attributes(torch_job: JobResults) -> None:
    zero, one = torch_job.all("sync")
    assert zero["snapshot"] == one["snapshot"]
    assert zero["snapshot"]["history"] == [0, 1] and zero["snapshot"]["lr"] == [0.005]
    # Every rank's recorded indices count: 8 from record_batch, 30 and 31 from record_indices.
    assert len(zero["snapshot"]["sampler"]["processed_indices"]) == 10
    assert {30, 31} <= zero["snapshot"]["sampler"]["processed_indices"]
    _assert_partition([zero["shard"], one["shard"]],
                      set(range(40)) - zero["snapshot"]["sampler"]["processed_indices"])


def test_after_a_commit_that_completed_on_some_ranks_only_every_shard_comes_from_rank_0s_commit(
        torch_job: JobResults) -> None:
    got = torch_job.get("partial_commit", 0)
    assert got["first"] != got["second"]  # the commits differ, so the check can tell them apart
    assert got["restored"] == got["first"]
    assert got["at_build"] == {}  # the first commit made on rank 1 only: back to no Adam state anywhere


def test_state_follows_a_reassigned_model(torch_job: JobResults) -> None:
    assert torch_job.get("reassigned", 0) == torch_job.get("reassigned", 1)


N, BATCH, EPOCHS = 24, 2, 2  # 2 ranks: 6 steps per epoch
ANNOUNCE_AT, FAIL_AT = (0, 3), (1, 3)  # (epoch, step): a host change, then a failed collective


def _plain(model: torch.nn.Module) -> dict[str, Any]:
    return {k: v.tolist() for k, v in model.state_dict().items()}


def _elastic_training() -> dict[str, Any]:
    """A training loop under hora.torch.elastic.run: every step all-gathers what every rank processed
    into ``state.seen`` (part of the state, so a restore drops steps after the last commit).
    Generations are counted from the one this section starts in."""
    start = generation()
    entries: list[dict[str, Any]] = []
    injected = {"announced": False, "failed": False}
    snapshots: dict[str, Any] = {}
    model = _model(seed=hvd.rank())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    dataset = torch.arange(N * 4, dtype=torch.float32).reshape(N, 4) / (N * 4)
    sampler = ElasticSampler(range(N), seed=11)
    state = TorchState(model, optimizer, train_sampler=sampler, epoch=0, seen=[[] for _ in range(EPOCHS)])

    @run
    def train(state: TorchState) -> int:
        entries.append({"pid": os.getpid(), "generation": generation() - start,
                        "size": hvd.size(), "epoch": state.epoch,
                        "model": _plain(state.model), "before_commit": snapshots.get("before_commit"),
                        "last_commit": snapshots.get("last_commit"), "at_failure": snapshots.get("at_failure")})
        while state.epoch < EPOCHS:
            loader = torch.utils.data.DataLoader(range(N), batch_size=BATCH, sampler=state.train_sampler)
            for step, indices in enumerate(loader):
                if (state.epoch, step) == FAIL_AT and not injected["failed"]:
                    injected["failed"] = True
                    snapshots["at_failure"] = _plain(state.model)
                    raise HorovodInternalError("injected: every rank fails at the same step")
                if (state.epoch, step) == ANNOUNCE_AT and not injected["announced"] and hvd.rank() == 0:
                    injected["announced"] = True
                    announce_host_change()
                _train_step(state.model, state.optimizer, dataset[indices])
                state.seen[state.epoch].extend(i for part in hvd.allgather_object(indices.tolist()) for i in part)
                state.train_sampler.record_batch(step, BATCH)
                if step % 2 == 1:
                    snapshots["before_commit"] = _plain(state.model)
                    state.commit()  # raises HostsUpdatedInterrupt at the announcement's step
                    snapshots["last_commit"] = snapshots["before_commit"]
            state.epoch += 1
            state.train_sampler.set_epoch(state.epoch)
            state.commit()
        return len(entries)

    calls = train(state)
    # Parameters only: BatchNorm's running statistics are each rank's own between syncs.
    final = {k: v.tolist() for k, v in state.model.named_parameters()}
    return {"calls": calls, "entries": entries, "seen": state.seen, "final": final,
            "generation": generation() - start}


@pytest.fixture(scope="module")
def training_job(torch_job: JobResults) -> list[dict[str, Any]]:
    return torch_job.all("training")


def test_elastic_loop_reforms_the_world_in_the_same_processes_as_new_rounds(training_job: list[dict[str, Any]]) -> None:
    for result in training_job:
        entries = result["entries"]
        assert result["calls"] == 3  # the first call, after the host change, after the failure
        assert [e["generation"] for e in entries] == [0, 1, 2]
        assert len({e["pid"] for e in entries}) == 1
        assert [e["size"] for e in entries] == [2, 2, 2]
        assert [e["epoch"] for e in entries] == [0, 0, 1]


def test_elastic_loop_processes_every_sample_exactly_once_per_epoch_across_resets(
        training_job: list[dict[str, Any]]) -> None:
    zero, one = training_job
    assert zero["seen"] == one["seen"]
    for epoch in range(EPOCHS):
        assert sorted(zero["seen"][epoch]) == list(range(N)), f"epoch {epoch}: {zero['seen'][epoch]}"


def test_elastic_loop_resumes_from_the_committed_model_on_every_rank(training_job: list[dict[str, Any]]) -> None:
    zero, one = training_job
    # The first entry's sync gave rank 1 rank 0's model; every later entry starts from rank 0's commit.
    for a, b in zip(zero["entries"], one["entries"]):
        assert a["model"] == b["model"]
    assert zero["final"] == one["final"]
    # Each later entry starts from rank 0's state (sync broadcasts it, BatchNorm's statistics too):
    _, after_host_change, after_failure = zero["entries"]
    for result in training_job:
        _, host_change_entry, failure_entry = result["entries"]
        # a host change keeps the state as it was at the interrupted commit (which saved it)...
        assert host_change_entry["model"] == after_host_change["before_commit"]
        # ...a failure rolls back the step taken after the last completed commit.
        assert failure_entry["model"] == after_failure["last_commit"]
    assert after_failure["at_failure"] != after_failure["last_commit"]
