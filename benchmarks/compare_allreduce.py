#!/usr/bin/env python
"""float32 allreduce, side by side: hora's transport (as init() picks it: shared memory within one
host) on its own buffers, hora's public API on NumPy arrays (``hora.allreduce_`` / ``hora.allreduce``)
and on CPU torch tensors (``hora.torch.allreduce_`` / ``allreduce``), hora's TCP ring,
torch.distributed over Gloo, and MPI (mpi4py).

All of them run the same size sweep with the same iteration plan (hora.bench's: ``--iters`` calls for
small messages, fewer for big ones), the same timing rule (warm-up, barrier, mean per call over the
timed loop, slowest rank wins) and the same world size. The machine is shared and noisy, so the
libraries take turns, round after round (hora, gloo, mpi, hora, gloo, mpi, ...), and each keeps its
best time per size. With ``--shared-workers`` every library but MPI takes its turns inside one set of
workers started once (so torch is imported once, not by every torch job): the timed loops are the
same, but the processes are warm and shared, so report numbers from fresh ones, the default.

    python benchmarks/compare_allreduce.py                      # 4 B .. 64 MiB, x4 steps, 3 rounds
    python benchmarks/compare_allreduce.py --sizes 4,64K,16M --rounds 5 --json
    python benchmarks/compare_allreduce.py --sizes 4,64K --rounds 1 --iters 5 --shared-workers   # does it run?

Ratios compare the public API in place (numpy = ``hora.allreduce_``, torch = ``hora.torch.allreduce_``,
summing as Gloo's and MPI's in-place calls here do) with Gloo and MPI: ``bw np/X`` above 1 means
hora moves data faster; ``lat np/X`` above 1 means hora takes longer per call. The out-of-place
calls (a new array or tensor per call) are in the JSON rows as ``numpy_oop`` and ``torch_oop``. A
library that is not installed is skipped with a note.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

DEFAULT_SIZES = tuple(4 * 4**k for k in range(13))  # 4 B .. 64 MiB
RESULT_TAG = "COMPARE_ALLREDUCE_RESULT "
# "hora" is what hora.init() picks (shared memory within one host); "hora_tcp" its TCP ring.
LIBRARIES = ("hora", "numpy", "numpy_oop", "torch", "torch_oop", "hora_tcp", "gloo", "mpi")
#: One job times both forms of a public API: (library of allreduce_, library of allreduce).
API_LIBRARIES = {"numpy": ("numpy", "numpy_oop"), "torch": ("torch", "torch_oop")}


def _plan(nbytes: int, iters: int, warmup: int) -> tuple[int, int]:
    from hora.bench.sweep import iteration_plan

    return iteration_plan(nbytes, iters, warmup)


def _count(nbytes: int) -> int:
    return max(1, nbytes // 4)


# ---- hora -----------------------------------------------------------------------------------------


def hora_worker(sizes: list[int], iters: int, warmup: int, transport: str) -> dict[int, float] | None:
    """One rank: the slowest rank's mean seconds per allreduce, by size (rank 0 only)."""
    from hora.bench.sweep import BenchSpec, bench_worker

    rows = bench_worker(BenchSpec(sizes=tuple(sizes), ops=("allreduce",), dtype="float32",
                                  iters=iters, warmup=warmup, transport=transport))
    return None if rows is None else {row["size"]: row["time_us"] * 1e-6 for row in rows}


def run_hora(sizes: list[int], iters: int, warmup: int, np_: int) -> dict[int, float]:
    import hora

    return hora.run(hora_worker, args=(sizes, iters, warmup, "auto"), np=np_)[0]


def run_hora_tcp(sizes: list[int], iters: int, warmup: int, np_: int) -> dict[int, float]:
    import hora

    return hora.run(hora_worker, args=(sizes, iters, warmup, "tcp"), np=np_)[0]


def api_worker(sizes: list[int], iters: int, warmup: int, api: str) -> dict[str, dict[int, float]] | None:
    """One rank of a public-API run: both calls' slowest-rank seconds per size, by library (rank 0)."""
    from hora.bench.api import api_worker as bench_api_worker
    from hora.bench.sweep import BenchSpec

    rows = bench_api_worker(BenchSpec(sizes=tuple(sizes), ops=("allreduce",), dtype="float32", iters=iters,
                                      warmup=warmup), api)
    if rows is None:
        return None
    inplace, out_of_place = API_LIBRARIES[api]
    out: dict[str, dict[int, float]] = {inplace: {}, out_of_place: {}}
    for row in rows:
        out[inplace if row["op"] == "allreduce_" else out_of_place][row["size"]] = row["time_us"] * 1e-6
    return out


def run_api(api: str) -> Callable[..., dict[str, dict[int, float]]]:
    def run(sizes: list[int], iters: int, warmup: int, np_: int) -> dict[str, dict[int, float]]:
        import hora

        return hora.run(api_worker, args=(sizes, iters, warmup, api), np=np_)[0]

    return run


# ---- torch.distributed / Gloo ---------------------------------------------------------------------


NO_GLOO = "this torch build has no Gloo backend"


def gloo_worker(sizes: list[int], iters: int, warmup: int, port: int) -> dict[int, float] | str | None:
    """One rank of the Gloo run; identity comes from the hora launcher's environment.

    Returns NO_GLOO (on every rank) where torch has no Gloo backend: asked here, where torch is
    imported anyway, so that the driver need not import it.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hora import config

    if not (dist.is_available() and dist.is_gloo_available()):
        return NO_GLOO
    rank, size = config.get("rank"), config.get("size")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=120))
    try:
        out: dict[int, float] = {}
        for nbytes in sizes:
            iters_n, warmup_n = _plan(nbytes, iters, warmup)
            buf = torch.zeros(_count(nbytes), dtype=torch.float32)
            for _ in range(warmup_n):
                dist.all_reduce(buf)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters_n):
                dist.all_reduce(buf)
            mean = torch.tensor([(time.perf_counter() - start) / iters_n], dtype=torch.float64)
            dist.all_reduce(mean, op=dist.ReduceOp.MAX)
            out[nbytes] = float(mean.item())
        return out if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


GLOO_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def run_gloo(sizes: list[int], iters: int, warmup: int, np_: int) -> dict[int, float] | str:
    import hora

    return hora.run(gloo_worker, args=(sizes, iters, warmup, _free_port()), np=np_, env=GLOO_ENV)[0]


# ---- every library but MPI in one job (--shared-workers) --------------------------------------------


def shared_worker(sizes: list[int], iters: int, warmup: int,
                  turns: list[tuple[str, int | None]]) -> list[Any] | None:
    """Every ``(library, Gloo port)`` turn in this one process, in order: rank 0's result of each.

    Each turn forms its own group and closes it, as its own job would: hora's transports and the
    public APIs join a new rendezvous round, Gloo forms a process group on its own port.
    """
    from hora import config

    results = []
    for lib, port in turns:
        if lib in ("hora", "hora_tcp"):
            results.append(hora_worker(sizes, iters, warmup, "auto" if lib == "hora" else "tcp"))
        elif lib in API_LIBRARIES:
            results.append(api_worker(sizes, iters, warmup, lib))
        else:
            assert lib == "gloo" and port is not None, lib
            results.append(gloo_worker(sizes, iters, warmup, port))
    return results if config.get("rank") == 0 else None


def run_shared(libs: list[str], sizes: list[int], iters: int, warmup: int, np_: int) -> list[Any]:
    """The results of every turn of ``libs`` (in order), all in one job of ``np_`` workers."""
    import hora

    turns = [(lib, _free_port() if lib == "gloo" else None) for lib in libs]
    return hora.run(shared_worker, args=(sizes, iters, warmup, turns), np=np_, env=GLOO_ENV)[0]


# ---- MPI ------------------------------------------------------------------------------------------


def mpi_worker_main(sizes: list[int], iters: int, warmup: int) -> int:
    """Body of each ``mpirun`` rank; rank 0 prints the result line."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out: dict[int, float] = {}
    for nbytes in sizes:
        iters_n, warmup_n = _plan(nbytes, iters, warmup)
        buf = np.zeros(_count(nbytes), dtype=np.float32)
        for _ in range(warmup_n):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iters_n):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        out[nbytes] = comm.allreduce((time.perf_counter() - start) / iters_n, op=MPI.MAX)
    if comm.rank == 0:
        print(RESULT_TAG + json.dumps(out), flush=True)
    return 0


def run_mpi(sizes: list[int], iters: int, warmup: int, np_: int) -> dict[int, float]:
    mpirun = shutil.which("mpirun")
    command = [
        mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
        sys.executable, os.path.abspath(__file__), "--mpi-worker",
        "--sizes", ",".join(str(s) for s in sizes), "--iters", str(iters), "--warmup", str(warmup),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return {int(k): float(v) for k, v in json.loads(line[len(RESULT_TAG):]).items()}
    raise RuntimeError(f"mpirun exited {proc.returncode} without a result: {(proc.stderr or proc.stdout)[-1500:]}")


# ---- driver ---------------------------------------------------------------------------------------


def available(note: Callable[[str], None]) -> dict[str, Callable[..., dict[int, float]]]:
    runners: dict[str, Callable[..., Any]] = {"hora": run_hora, "numpy": run_api("numpy"),
                                              "hora_tcp": run_hora_tcp}
    # Found, not imported: the driver has no use for torch itself (gloo_worker checks for Gloo).
    if importlib.util.find_spec("torch") is not None:
        runners["torch"] = run_api("torch")
        runners["gloo"] = run_gloo
    else:
        note("skipping gloo: torch is not installed (pip install torch)")
    try:
        import mpi4py  # noqa: F401 - only to check it is installed

        if shutil.which("mpirun"):
            runners["mpi"] = run_mpi
        else:
            note("skipping mpi: mpirun is not on PATH (install Open MPI or MPICH)")
    except ImportError:
        note("skipping mpi: mpi4py is not installed (pip install mpi4py)")
    return runners


def bus_bandwidth(nbytes: int, seconds: float | None, np_: int) -> float | None:
    """GB/s, nccl-tests' allreduce bus bandwidth: size / time x 2(n-1)/n."""
    if seconds is None or seconds <= 0:
        return None
    return nbytes / seconds / 1e9 * 2 * (np_ - 1) / np_


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def build_rows(sizes: list[int], best: dict[str, dict[int, float]], np_: int) -> list[dict[str, Any]]:
    rows = []
    for nbytes in sizes:
        row: dict[str, Any] = {"size": _count(nbytes) * 4, "count": _count(nbytes), "np": np_}
        for lib in LIBRARIES:
            seconds = best.get(lib, {}).get(nbytes)
            row[f"{lib}_us"] = None if seconds is None else seconds * 1e6
            row[f"{lib}_busbw"] = bus_bandwidth(_count(nbytes) * 4, seconds, np_)
        for other in ("gloo", "mpi"):
            for mine in ("hora", "numpy", "torch"):
                row[f"busbw_{mine}/{other}"] = _ratio(row[f"{mine}_busbw"], row[f"{other}_busbw"])
                row[f"lat_{mine}/{other}"] = _ratio(row[f"{mine}_us"], row[f"{other}_us"])
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]], np_: int, rounds: int) -> str:
    columns = [
        ("size(B)", "size", "{:d}", 11),
        ("hora(us)", "hora_us", "{:.1f}", 10), ("np(us)", "numpy_us", "{:.1f}", 10),
        ("torch(us)", "torch_us", "{:.1f}", 10), ("tcp(us)", "hora_tcp_us", "{:.1f}", 10),
        ("gloo(us)", "gloo_us", "{:.1f}", 10), ("mpi(us)", "mpi_us", "{:.1f}", 10),
        ("hora GB/s", "hora_busbw", "{:.3f}", 10), ("np GB/s", "numpy_busbw", "{:.3f}", 10),
        ("np-oop", "numpy_oop_busbw", "{:.3f}", 8), ("torch GB/s", "torch_busbw", "{:.3f}", 11),
        ("t-oop", "torch_oop_busbw", "{:.3f}", 8), ("tcp GB/s", "hora_tcp_busbw", "{:.3f}", 10),
        ("gloo GB/s", "gloo_busbw", "{:.3f}", 10), ("mpi GB/s", "mpi_busbw", "{:.3f}", 10),
        ("bw np/gloo", "busbw_numpy/gloo", "{:.2f}", 11), ("bw np/mpi", "busbw_numpy/mpi", "{:.2f}", 10),
        ("bw t/gloo", "busbw_torch/gloo", "{:.2f}", 10), ("bw t/mpi", "busbw_torch/mpi", "{:.2f}", 9),
        ("lat np/gloo", "lat_numpy/gloo", "{:.2f}", 12), ("lat t/gloo", "lat_torch/gloo", "{:.2f}", 11),
        ("lat np/mpi", "lat_numpy/mpi", "{:.2f}", 11), ("lat t/mpi", "lat_torch/mpi", "{:.2f}", 10),
    ]
    lines = [
        f"# float32 allreduce, {np_} ranks, best of {rounds} interleaved round(s); time = slowest rank's mean per call",
        "# hora = its transport on its own buffers (shared memory on one host); np / torch = the public API in place",
        "# (hora.allreduce_ on NumPy arrays / hora.torch.allreduce_ on CPU torch tensors); np-oop / t-oop = the",
        "# out-of-place calls (a new result each call); tcp = hora's TCP ring",
        "# GB/s = bus bandwidth (size/time x 2(n-1)/n); bw np/X > 1: hora faster; lat np/X > 1: hora slower",
        "".join(title.rjust(width) for title, _, _, width in columns),
    ]
    for row in rows:
        cells = []
        for _, key, fmt, width in columns:
            value = row.get(key)
            cells.append(("-" if value is None else fmt.format(value)).rjust(width))
        lines.append("".join(cells))
    return "\n".join(lines)


def parse_sizes(text: str) -> list[int]:
    from hora.bench.sweep import parse_size

    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive byte counts, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", "--num-proc", dest="np", type=int, default=2, help="ranks per library (default 2)")
    parser.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES),
                        help="comma-separated sizes in bytes, K/M/G suffixes allowed (default 4 .. 64M, x4)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per size for small sizes (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up calls per size (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; best per size wins (default 3)")
    parser.add_argument("--only", default=",".join(LIBRARIES),
                        help="comma-separated subset of hora,numpy,torch,hora_tcp,gloo,mpi")
    parser.add_argument("--shared-workers", action="store_true",
                        help="run every library but MPI in one set of workers started once: less start-up; "
                             "the processes are warm and shared, so not for results")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of the table")
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mpi_worker:
        return mpi_worker_main(args.sizes, args.iters, args.warmup)
    if args.np < 2 or args.rounds < 1 or args.iters < 1:
        parser.error("need -np >= 2, --rounds >= 1 and --iters >= 1")

    def note(text: str) -> None:
        print(f"# {text}", file=sys.stderr if args.json else sys.stdout, flush=True)

    wanted = [lib.strip() for lib in args.only.split(",") if lib.strip()]
    runners = {lib: run for lib, run in available(note).items() if lib in wanted}
    best: dict[str, dict[int, float]] = {lib: {} for lib in runners}

    def keep(lib: str, times: Any) -> None:
        for name, by_size in (times.items() if lib in API_LIBRARIES else [(lib, times)]):
            for nbytes, seconds in by_size.items():
                best.setdefault(name, {})
                best[name][nbytes] = min(seconds, best[name].get(nbytes, float("inf")))

    if args.shared_workers:
        shared = [lib for lib in runners if lib != "mpi"]
        turns = [lib for _ in range(args.rounds) for lib in shared]
        started = time.monotonic()
        try:
            results = run_shared(turns, args.sizes, args.iters, args.warmup, args.np)
        except Exception as exc:  # MPI still runs
            note(f"the shared workers failed; dropping {','.join(shared)}: {type(exc).__name__}: {exc}")
            results = []
        for lib, times in zip(turns, results):
            if times != NO_GLOO:
                keep(lib, times)
        if NO_GLOO in results:
            note(f"skipping gloo: {NO_GLOO}")
        runners = {lib: run for lib, run in runners.items() if lib == "mpi"}
        if not args.json:
            note(f"{','.join(shared)}: {args.rounds} round(s) in one job took {time.monotonic() - started:.1f} s")
    for round_index in range(args.rounds):
        for lib in list(runners):
            started = time.monotonic()
            try:
                times = runners[lib](args.sizes, args.iters, args.warmup, args.np)
            except Exception as exc:  # one library failing must not hide the others
                note(f"{lib} failed in round {round_index + 1}; dropping it: {type(exc).__name__}: {exc}")
                del runners[lib]
                continue
            if times == NO_GLOO:
                note(f"skipping gloo: {NO_GLOO}")
                del runners[lib]
                continue
            keep(lib, times)
            if not args.json:
                note(f"round {round_index + 1}/{args.rounds}: {lib} took {time.monotonic() - started:.1f} s")
    rows = build_rows(args.sizes, best, args.np)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows, args.np, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
