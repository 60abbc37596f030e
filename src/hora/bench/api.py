"""``hora bench --api numpy|torch``: allreduce through the public API, as a training script calls it.

The transport sweep (:mod:`hora.bench.sweep`) times the communicator on its own buffers; this one
times what users feel: ``hora.allreduce`` / ``hora.allreduce_`` on plain NumPy arrays, or
``hora.torch.allreduce`` / ``allreduce_`` on CPU torch tensors, through the engine (negotiation,
response cache, copies in and out). Each size uses one fixed tensor name, as a gradient does, and
the same timing rule as the transport sweep (warm-up, barrier, slowest rank's mean per call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hora.bench.sweep import BenchRow, BenchSpec, bus_factor, iteration_plan, parse_dtype, time_calls, timed_row
from hora.errors import HoraError

APIS: tuple[str, ...] = ("transport", "numpy", "torch", "torch-cuda")
#: What each API's rows were measured on (the table's title).
API_SUBJECTS = {"numpy": "NumPy arrays", "torch": "CPU torch tensors",
                "torch-cuda": "CUDA torch tensors (NCCL when usable; each call waits for the GPU)"}
#: The public calls measured per API: out of place (a new result) and in place (into the caller's buffer).
API_OPS: tuple[str, ...] = ("allreduce", "allreduce_")


def _calls(api: str, count: int, dtype: np.dtype, name: str | None) -> dict[str, Callable[[], Any]]:
    """The out-of-place and in-place calls on one buffer of ``count`` elements (summed, as the
    other libraries in benchmarks/compare_allreduce.py do), named after ``name`` (None: unnamed)."""
    in_place = None if name is None else name + "_"
    if api == "numpy":
        import hora

        buf = np.zeros(count, dtype=dtype)
        return {"allreduce": lambda: hora.allreduce(buf, name=name, op=hora.Sum),
                "allreduce_": lambda: hora.allreduce_(buf, name=in_place, op=hora.Sum)}
    if api == "torch":
        import torch

        import hora.torch as hvd
        from hora.torch.tensors import new_like

        tensor = new_like(np.zeros(count, dtype=dtype))
        assert isinstance(tensor, torch.Tensor)
        return {"allreduce": lambda: hvd.allreduce(tensor, name=name, op=hvd.Sum),
                "allreduce_": lambda: hvd.allreduce_(tensor, name=in_place, op=hvd.Sum)}
    if api == "torch-cuda":
        import torch

        import hora.torch as hvd

        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        tensor = torch.zeros(count, dtype=torch.from_numpy(np.zeros(0, dtype=dtype)).dtype, device=device)

        def synced(call: Callable[[], Any]) -> Callable[[], Any]:
            # a CUDA collective returns once enqueued: wait for the GPU so each call is timed whole
            return lambda: (call(), torch.cuda.synchronize(device))

        return {"allreduce": synced(lambda: hvd.allreduce(tensor, name=name, op=hvd.Sum)),
                "allreduce_": synced(lambda: hvd.allreduce_(tensor, name=in_place, op=hvd.Sum))}
    raise ValueError(f"unknown API {api!r}; choose from {', '.join(APIS)}")


def api_worker(spec: BenchSpec, api: str) -> list[dict[str, Any]] | None:
    """One rank of an API benchmark job: init hora, sweep, return rank 0's rows (None elsewhere)."""
    import hora

    if api in ("torch", "torch-cuda"):
        import hora.torch  # fail here, naming torch, before anything is timed
    if api == "torch-cuda":
        import socket

        import torch

        if not torch.cuda.is_available():
            raise HoraError(f"--api torch-cuda needs a CUDA GPU on every rank, but torch.cuda.is_available() "
                            f"is False on {socket.gethostname()} (torch {torch.__version__})")
    hora.init()  # the transport comes from HORA_TRANSPORT (run_api_job sets it for --transport)
    try:
        return measure_api(spec, api)
    finally:
        hora.shutdown()


def measure_api(spec: BenchSpec, api: str) -> list[dict[str, Any]] | None:
    """Time every (call, size) of ``spec`` through ``api`` on every rank of the initialised job."""
    import hora

    dtype = parse_dtype(spec.dtype)
    size, rank = hora.size(), hora.rank()
    from hora.basics import engine as current_engine

    engine = current_engine()
    rows: list[BenchRow] = []
    negotiated: list[float] = []
    ops = [op for op in API_OPS if op in spec.ops or op.rstrip("_") in spec.ops]
    for op in ops:
        factor = bus_factor("allreduce", size)
        done: set[int] = set()
        for nbytes in spec.sizes:
            count = max(1, int(nbytes) // dtype.itemsize)
            nbytes = count * dtype.itemsize
            if nbytes in done:
                continue
            done.add(nbytes)
            iters, warmup = iteration_plan(nbytes, spec.iters, spec.warmup, spec.budget_bytes)
            call = _calls(api, count, dtype, None if spec.unnamed else f"bench.{api}.{nbytes}")[op]
            marks: list[int] = []  # name-negotiation rounds when the timed calls start and end

            def barrier(marks: list[int] = marks) -> None:
                hora.barrier()
                marks.append(engine.negotiation_rounds)

            def gather(mean: float, marks: list[int] = marks) -> list[float]:
                marks.append(engine.negotiation_rounds)
                return hora.allgather_object(mean)

            times = time_calls(call, iters, warmup, barrier, gather)
            negotiated.append((marks[1] - marks[0]) / iters)
            del call
            assert times is not None
            rows.append(timed_row(op, nbytes, count, dtype, times, factor, iters, size, spec.transport))
    if rank != 0:
        return None
    # negotiations: name-negotiation rounds per timed call on rank 0 (0 when the response cache serves
    # the calls; at least 1 for unnamed ones).
    return [dict(row.as_dict(), api=api, named=not spec.unnamed, negotiations=round(rounds, 3))
            for row, rounds in zip(rows, negotiated)]


def run_api_job(spec: BenchSpec, api: str, np: int, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Launch ``np`` local workers with :func:`hora.run` and return the API sweep's rows."""
    import hora

    env = dict(env or {})
    if spec.transport != "auto":
        env["HORA_TRANSPORT"] = spec.transport
    return hora.run(api_worker, args=(spec, api), np=np, env=env)[0] or []
