"""hora.run(func, min_np=..., max_np=..., discovery=...): an elastic job from Python.

The discovery function is called in this process by the driver; the function run on the workers
wraps its loop in hora.elastic.run. One worker of three fails mid-training; the survivors finish in
their own processes, and hora.run returns one result per rank of the final world.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hora
from hora.errors import WorkerFailedError

pytestmark = pytest.mark.timeout(120)


def _train(mark: str) -> tuple[int, int, int, list[int]]:
    import hora
    import hora.elastic

    hora.init()
    state = hora.elastic.ObjectState(step=0, totals=[])

    @hora.elastic.run
    def loop(state: Any) -> tuple[int, int, int, list[int]]:
        while state.step < 12:
            if state.step == 4 and hora.size() == 3 and os.environ["HORA_HOSTNAME"] == "127.0.0.1" \
                    and not os.path.exists(mark):
                open(mark, "w").close()
                os._exit(3)  # a worker dies without a word, mid-training
            total = hora.allreduce(np.ones(1), op=hora.Sum, name="step")
            state.totals.append(int(total[0]))
            state.step += 1
            state.commit()
        return hora.rank(), hora.size(), os.getpid(), list(state.totals)

    return loop(state)


def test_hora_run_elastic_with_a_discovery_function_survives_a_dead_worker_and_returns_the_final_world(
        tmp_path: Path, no_hora_env: None) -> None:
    calls = []

    def discover() -> dict[str, int]:
        calls.append(1)
        return {"localhost": 2, "127.0.0.1": 1}

    results = hora.run(_train, args=(str(tmp_path / "died"),), np=3, min_np=2, max_np=3, discovery=discover,
                       elastic_timeout=60)
    assert (tmp_path / "died").exists() and calls
    assert [(rank, size) for rank, size, _, _ in results] == [(0, 2), (1, 2)]
    assert len({pid for _, _, pid, _ in results}) == 2
    for *_, totals in results:  # 4 committed steps in the world of 3, then 8 in the world of 2
        assert totals == [3] * 4 + [2] * 8


def test_hora_run_elastic_ends_with_an_error_naming_the_bound_when_too_few_hosts_are_left(
        tmp_path: Path, no_hora_env: None) -> None:
    with pytest.raises(WorkerFailedError, match=r"hora\.run: elastic job stops: only 2 slot\(s\) are left.*"
                                                r"fewer than --min-np 3.*exited with status 3"):
        hora.run(_train, args=(str(tmp_path / "died"),), np=3, min_np=3,
                 hosts="localhost:2,127.0.0.1:1", elastic_timeout=60)


def _finish_while_hosts_grow(grow: str) -> tuple[int, int]:
    import time

    import hora
    import hora.elastic

    hora.init()
    state = hora.elastic.ObjectState(step=0)

    @hora.elastic.run
    def loop(state: Any) -> tuple[int, int]:
        while state.step < 3:
            hora.allreduce(np.ones(1), name="step")
            state.step += 1
            state.commit()
        # A host appears after the last commit (during a final evaluation, say): nobody commits
        # again, so nobody answers the driver's announcement before training ends.
        if hora.rank() == 0:
            open(grow, "w").close()
        time.sleep(4)  # meanwhile the driver opens a round for the new host and starts its worker
        return hora.rank(), hora.size()

    return loop(state)


def test_training_that_ends_while_a_new_round_forms_ends_promptly_with_the_formed_world(
        tmp_path: Path, no_hora_env: None) -> None:
    import time

    grow = tmp_path / "grow"

    def discover() -> dict[str, int]:
        return {"localhost": 2 if grow.exists() else 1}

    began = time.monotonic()
    results = hora.run(_finish_while_hosts_grow, args=(str(grow),), np=1, min_np=1, max_np=2, discovery=discover,
                       elastic_timeout=60)
    assert grow.exists()
    # The world of 1 trained and finished; the worker started for the round of 2 was stopped at once
    # instead of waiting out its start time-out for peers that were done.
    assert results == [(0, 1)]
    assert time.monotonic() - began < 30
