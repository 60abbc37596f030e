#!/usr/bin/env python
"""Data-parallel training throughput, side by side: hora.torch's DistributedOptimizer, PyTorch's
DistributedDataParallel over Gloo, and one process with no distribution at all.

All three train the synthetic benchmark's model (examples/pytorch_synthetic_benchmark.py) on the
same fixed random batch, with the same batch size per worker, the same CPU threads per worker and
the same number of timed steps after the same warm-up. Every worker is a fresh process started by
``hora.run``; DDP's workers get MASTER_ADDR/MASTER_PORT and form a Gloo process group instead of
calling ``hvd.init()``. The machine is shared and noisy, so the contenders take turns, round after
round (hora, ddp, single, hora, ddp, single, ...), and the median round is reported.

With ``--shared-workers`` one set of worker processes is started once and every turn of every round
runs inside it (``single`` on rank 0 alone): the timed steps are the same, only the start-up (each
worker importing torch) is paid once instead of per turn. The contenders then share warm processes
(allocator, thread pools), so report numbers from fresh processes, the default.

    python benchmarks/torch_vs_ddp.py                         # resnet18, 64x64, batch 16, 2 workers
    python benchmarks/torch_vs_ddp.py --rounds 5 --iters 30 --json
    python benchmarks/torch_vs_ddp.py --hora-env HORA_CYCLE_TIME=20      # try an engine knob
    python benchmarks/torch_vs_ddp.py --model mlp200 --threads 1 --only hora,ddp   # issue 17's bar
    python benchmarks/torch_vs_ddp.py --shared-workers --rounds 1 --iters 2   # a quick check that it runs

``--model mlp200`` is issue 17's bar: 100 Linear layers 64-256 wide (200 gradient tensors, 256
classes), batch 32, one thread per rank. For hora the report adds the engine's CPU time per step per
gradient tensor (see EngineCpuMeter): with the transport's share, and without it.

Throughput is images per second: ``batch x steps / seconds`` with the slowest rank's seconds, per
worker and in total. ``hora/ddp`` above 1 means hora trains faster; ``X/single`` is the total
throughput of X over that of one undistributed process (the ideal is the number of workers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from synthetic_models import CLASSES, load_model

CONTENDERS = ("hora", "ddp", "single")
#: Images per worker per step where --batch-size is not given (the bar's batch for mlp200).
BATCH = {"mlp200": 32}
#: What EngineCpuMeter reports from hora's rank 0, per step (medians over rounds in the summary).
ENGINE_FIELDS = ("engine_us_per_tensor", "engine_excl_transport_us_per_tensor", "engine_scaling_us_per_tensor",
                 "engine_thread_us_per_tensor", "cycles_per_step", "transport_calls_per_step")


@dataclass(frozen=True)
class Config:
    model: str
    batch_size: int
    image_size: int
    warmup: int
    iters: int
    threads: int
    fp16_allreduce: bool = False


# ---- what every contender shares -------------------------------------------------------------------


def _build(cfg: Config, seed: int):
    """The model, an SGD optimizer on it, one synthetic batch, and the loss function."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(seed)
    classes = CLASSES.get(cfg.model, 1000)
    model = load_model(cfg.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)
    target = torch.randint(0, classes, (cfg.batch_size,))
    return model, optimizer, data, target, F.cross_entropy


def _timed_steps(step: Callable[[], float], cfg: Config, barrier: Callable[[], None],
                 meter: EngineCpuMeter | None = None) -> tuple[float, float, float]:
    """Warm up, line the ranks up, then time ``cfg.iters`` steps (``meter``, if any, runs over them).

    Returns (seconds, last loss, CPU seconds per step of this whole process: every thread, so the
    communication threads' share shows next to the training thread's).
    """
    for _ in range(cfg.warmup):
        step()
    barrier()
    if meter is not None:
        meter.start()
    cpu = time.process_time()
    start = time.perf_counter()
    loss = 0.0
    for _ in range(cfg.iters):
        loss = step()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if meter is not None:
        meter.stop()
    return seconds, loss, cpu / cfg.iters


class EngineCpuMeter:
    """CPU time hora's engine spends during the timed steps, in whichever thread it spends it.

    The engine works in two kinds of thread (docs/architecture.md, "Who runs the engine cycle"): its
    background thread (idle cycles during the forward pass, cycles for gradients submitted during
    backward, the short waits between cycles) and a thread waiting on a handle, which runs the cycles
    itself (``Engine.drive``). The background thread's CPU clock is read from outside
    (``pthread_getcpuclockid``), so nothing in that thread is instrumented; in the training thread
    the meter adds the thread CPU time spent inside ``Engine.submit`` and ``Engine.drive``.

    The engine's calls into the transport (the control vector, the object exchange of a negotiation,
    the gradient allreduce) are timed with thread CPU time as well, so that the engine's own share
    can be told from the transport's. The transport's share is the reduction itself plus its wait for
    the peer, which costs CPU because the shared-memory transport polls (a spin, then ``sleep(0)``,
    then growing naps) instead of blocking. The engine's own share still holds its per-byte work: the
    copies into and out of the transport's buffer and Average's scaling.
    """

    TRANSPORT_CALLS = ("allreduce", "allreduce_into", "gather_object", "broadcast_object", "allgather", "broadcast",
                       "barrier")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.clock = time.pthread_getcpuclockid(engine.thread.ident)
        self.seconds = {"driver": 0.0, "transport": 0.0, "scale": 0.0}
        self.calls = {"driver": 0, "transport": 0, "cycles": 0, "scale": 0}
        self.on = False
        self._wrap(engine, ("submit", "drive"), "driver")
        for state in engine._states:
            self._wrap(state.comm, self.TRANSPORT_CALLS, "transport")
            for attr, value in vars(state.executor).items():  # transport methods the executor keeps bound
                if getattr(value, "__self__", None) is state.comm and value.__name__ in self.TRANSPORT_CALLS:
                    setattr(state.executor, attr, getattr(state.comm, value.__name__))
        from hora.engine import executor

        self._wrap(executor, ("_scale",), "scale")  # Average's division: one pass over every bucket
        iterate = engine.iterate

        def counted() -> None:
            if self.on:
                self.calls["cycles"] += 1
            iterate()
        engine.iterate = counted

    def _wrap(self, obj: Any, names: tuple[str, ...], key: str) -> None:
        clock = time.thread_time
        for name in names:
            method = getattr(obj, name, None)
            if method is None:
                continue

            def timed(*args, _method=method, **kwargs):
                if not self.on:
                    return _method(*args, **kwargs)
                began = clock()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.seconds[key] += clock() - began
                    self.calls[key] += 1
            setattr(obj, name, timed)

    def start(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.calls = dict.fromkeys(self.calls, 0)
        self.thread_began = time.clock_gettime(self.clock)
        self.on = True

    def stop(self) -> None:
        self.on = False
        self.seconds["thread"] = time.clock_gettime(self.clock) - self.thread_began

    def per_step(self, steps: int, tensors: int) -> dict[str, float]:
        """Microseconds per step per tensor: the engine with the transport's share, and without it."""
        total = self.seconds["thread"] + self.seconds["driver"]
        scale = 1e6 / steps / tensors
        return {"engine_us_per_tensor": total * scale,
                "engine_excl_transport_us_per_tensor": (total - self.seconds["transport"]) * scale,
                "engine_scaling_us_per_tensor": self.seconds["scale"] * scale,
                "engine_thread_us_per_tensor": self.seconds["thread"] * scale,
                "cycles_per_step": self.calls["cycles"] / steps,
                "transport_calls_per_step": self.calls["transport"] / steps}


# ---- the contenders (each function body runs in a worker process) ---------------------------------


def hora_worker(cfg: Config) -> dict[str, float] | None:
    import hora.torch as hvd

    hvd.init()
    model, optimizer, data, target, loss_fn = _build(cfg, seed=1234 + hvd.rank())
    compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def step() -> float:
        optimizer.zero_grad()
        loss = loss_fn(model(data), target)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    from hora import basics

    meter = EngineCpuMeter(basics.engine())
    seconds, loss, cpu = _timed_steps(step, cfg, hvd.barrier, meter)
    slowest = max(hvd.allgather_object(seconds))
    rank = hvd.rank()
    hvd.shutdown()
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    result = {"seconds": slowest, "loss": loss, "cpu_per_step": cpu, "tensors": tensors}
    result.update(meter.per_step(cfg.iters, tensors))
    return result if rank == 0 else None


def ddp_worker(cfg: Config) -> dict[str, float]:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hora import config

    # Identity from the hora launcher's environment; the rendezvous is torch's own (MASTER_ADDR/PORT).
    rank, size = config.get("rank"), config.get("size")
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=120))
    try:
        model, optimizer, data, target, loss_fn = _build(cfg, seed=1234 + rank)
        ddp_model = DistributedDataParallel(model)  # broadcasts rank 0's parameters and buffers
        if cfg.fp16_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)

        def step() -> float:
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(data), target)
            loss.backward()
            optimizer.step()
            return float(loss.detach())

        seconds, loss, cpu = _timed_steps(step, cfg, dist.barrier)
        # Every rank reports its own time and the driver takes the slowest (_slowest). A last Gloo
        # collective here (all_gather_object) may hang the process as the group is freed right after
        # it: Gloo's thread still needs the GIL to drop the gathered tensors, which the group's
        # destructor holds while it waits for that thread (--shared-workers, where the process goes
        # on, met it in one run out of two).
        return {"seconds": seconds, "loss": loss, "cpu_per_step": cpu}
    finally:
        dist.destroy_process_group()


def single_worker(cfg: Config) -> dict[str, float]:
    model, optimizer, data, target, loss_fn = _build(cfg, seed=1234)

    def step() -> float:
        optimizer.zero_grad()
        loss = loss_fn(model(data), target)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    seconds, loss, cpu = _timed_steps(step, cfg, lambda: None)
    return {"seconds": seconds, "loss": loss, "cpu_per_step": cpu}


# ---- driver ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_env() -> dict[str, str]:
    """Where DDP's workers meet: torch's own rendezvous on a free local port."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "GLOO_SOCKET_IFNAME": "lo"}


def run_contender(name: str, cfg: Config, np_: int, hora_env: dict[str, str] | None = None) -> dict[str, float]:
    """One timed run of one contender in fresh worker processes: seconds and img/sec."""
    import hora

    env = {"OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads)}
    if name == "hora":
        env.update(hora_env or {})
    if name == "ddp":
        env.update(_ddp_env())
    worker = {"hora": hora_worker, "ddp": ddp_worker, "single": single_worker}[name]
    workers = 1 if name == "single" else np_
    return _row(cfg, _slowest(hora.run(worker, args=(cfg,), np=workers, env=env)), workers)


def _slowest(per_rank: list[dict[str, float] | None]) -> dict[str, float]:
    """Rank 0's result with the slowest rank's seconds (hora's ranks agree on them already; the
    other ranks of hora and single return None)."""
    return {**per_rank[0], "seconds": max(result["seconds"] for result in per_rank if result is not None)}


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` set inside the block: what a turn's fresh workers would have had."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def shared_worker(cfg: Config, turns: list[str], hora_env: dict[str, str],
                  ddp_envs: list[dict[str, str]]) -> list[dict[str, float] | None]:
    """Every turn in this one process, in order (``--shared-workers``): this rank's result of each turn.

    hora's turns join and leave the job (``hvd.init()`` ... ``hvd.shutdown()``) with ``hora_env``
    set, as their own workers would have it; DDP's form and destroy a Gloo group, each on its own
    port (``ddp_envs``, one per DDP turn). ``single`` runs on rank 0 alone: the other ranks go on to
    the next turn and wait there for rank 0 to join it (hence the job's long start timeout).
    """
    from hora import config

    rank = config.get("rank")
    ddp_turns = iter(ddp_envs)
    results: list[dict[str, float] | None] = []
    for name in turns:
        if name == "hora":
            with _environ(hora_env):
                results.append(hora_worker(cfg))
        elif name == "ddp":
            with _environ(next(ddp_turns)):
                results.append(ddp_worker(cfg))
        else:
            results.append(single_worker(cfg) if rank == 0 else None)
    return results


def run_shared(turns: list[str], cfg: Config, np_: int, hora_env: dict[str, str]) -> list[dict[str, float]]:
    """Every turn in one job of ``np_`` workers started once: one row per turn, in order."""
    import hora

    # A rank waits in the next turn's hvd.init() while rank 0 runs its single turn: give it time.
    env = {"OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads), "HORA_START_TIMEOUT": "600"}
    ddp_envs = [_ddp_env() for name in turns if name == "ddp"]
    per_rank = hora.run(shared_worker, args=(cfg, turns, hora_env, ddp_envs), np=np_, env=env)
    return [_row(cfg, _slowest([results[turn] for results in per_rank]), 1 if name == "single" else np_)
            for turn, name in enumerate(turns)]


def _row(cfg: Config, result: dict[str, float], workers: int) -> dict[str, float]:
    """A turn's report row from rank 0's result: seconds and img/sec."""
    per_worker = cfg.batch_size * cfg.iters / result["seconds"]
    row = {"seconds": result["seconds"], "loss": result["loss"], "workers": workers,
           "img_sec_per_worker": per_worker, "img_sec_total": per_worker * workers,
           "cpu_ms_per_step": result["cpu_per_step"] * 1000, "tensors": result.get("tensors")}
    row.update({key: result[key] for key in ENGINE_FIELDS if key in result})
    return row


def summarise(runs: dict[str, list[dict[str, float]]], np_: int) -> dict[str, Any]:
    """Median round per contender, and the ratios between medians."""
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        if not results:
            continue
        totals = [r["img_sec_total"] for r in results]
        summary[name] = {
            "workers": results[0]["workers"],
            "img_sec_total": statistics.median(totals),
            "img_sec_per_worker": statistics.median(r["img_sec_per_worker"] for r in results),
            "img_sec_total_best": max(totals),
            "img_sec_total_rounds": totals,
            "cpu_ms_per_step": statistics.median(r["cpu_ms_per_step"] for r in results),
        }

    def ratio(a: str, b: str) -> float | None:
        if a in summary and b in summary and summary[b]["img_sec_total"] > 0:
            return summary[a]["img_sec_total"] / summary[b]["img_sec_total"]
        return None

    summary["ratios"] = {"hora/ddp": ratio("hora", "ddp"), "hora/single": ratio("hora", "single"),
                         "ddp/single": ratio("ddp", "single")}
    if "hora" in summary and runs["hora"][0].get("engine_us_per_tensor") is not None:
        summary["hora"]["engine"] = {key: statistics.median(r[key] for r in runs["hora"]) for key in ENGINE_FIELDS}
        summary["hora"]["engine_us_per_tensor_rounds"] = [r["engine_us_per_tensor"] for r in runs["hora"]]
        summary["hora"]["engine_excl_transport_us_per_tensor_rounds"] = [
            r["engine_excl_transport_us_per_tensor"] for r in runs["hora"]]
    if "hora" in summary and "single" in summary and runs["hora"][0].get("tensors"):
        # What distribution adds to a process's CPU time per step, per gradient tensor: hooks,
        # engine submission, negotiation and completion, copies and the transport together.
        extra_ms = summary["hora"]["cpu_ms_per_step"] - summary["single"]["cpu_ms_per_step"]
        summary["hora_extra_cpu_us_per_tensor"] = extra_ms * 1000 / runs["hora"][0]["tensors"]
    return summary


def format_report(summary: dict[str, Any], cfg: Config, np_: int, rounds: int) -> str:
    lines = [
        f"# {cfg.model}, {cfg.image_size}x{cfg.image_size} images, batch {cfg.batch_size} per worker, "
        f"{cfg.threads} thread(s) per worker, {cfg.iters} timed steps after {cfg.warmup} warm-up; "
        f"median of {rounds} interleaved round(s)",
        f"{'contender':<28}{'workers':>8}{'img/sec total':>15}{'per worker':>12}{'best total':>12}"
        f"{'CPU ms/step':>13}",
    ]
    labels = {"hora": "hora DistributedOptimizer", "ddp": "torch DDP (gloo)", "single": "1 process, no distribution"}
    for name in CONTENDERS:
        row = summary.get(name)
        if row is None:
            continue
        lines.append(f"{labels[name]:<28}{row['workers']:>8d}{row['img_sec_total']:>15.1f}"
                     f"{row['img_sec_per_worker']:>12.1f}{row['img_sec_total_best']:>12.1f}"
                     f"{row['cpu_ms_per_step']:>13.0f}")
    for key, value in summary["ratios"].items():
        if value is not None:
            lines.append(f"ratio {key}: {value:.3f}")
    if summary["ratios"]["hora/single"] is not None:
        lines.append(f"# X/single: total throughput over one process (ideal: {np_})")
    lines.append("# CPU ms/step: rank 0's process CPU time per step, all threads (training + communication)")
    engine = summary.get("hora", {}).get("engine")
    if engine is not None:
        lines.append(f"hora engine CPU per step per gradient tensor: {engine['engine_us_per_tensor']:.2f} us with the "
                     f"transport's share (reduction and polling wait), "
                     f"{engine['engine_excl_transport_us_per_tensor']:.2f} us without it (of which "
                     f"{engine['engine_scaling_us_per_tensor']:.2f} us Average's scaling pass over "
                     f"the gradients); background thread alone {engine['engine_thread_us_per_tensor']:.2f} us; "
                     f"{engine['cycles_per_step']:.1f} cycles and {engine['transport_calls_per_step']:.1f} "
                     "transport calls per step (rank 0)")
    if summary.get("hora_extra_cpu_us_per_tensor") is not None:
        lines.append(f"hora's CPU time per step beyond one process's, per gradient tensor: "
                     f"{summary['hora_extra_cpu_us_per_tensor']:.1f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", "--num-proc", dest="np", type=int, default=2,
                        help="workers for hora and DDP (default 2)")
    parser.add_argument("--model", default="resnet18", help="a model of the synthetic benchmark (default resnet18)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="images per worker per step (default 16; 32 for mlp200)")
    parser.add_argument("--image-size", type=int, default=64, help="image height and width (default 64)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker, the same for all (default: cores // np, at least 1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported (default 3)")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="fp16 gradients on the wire (hora: Compression.fp16; DDP: fp16_compress_hook)")
    parser.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated subset of hora,ddp,single")
    parser.add_argument("--hora-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for hora's workers only, e.g. HORA_CYCLE_TIME=5 (repeatable)")
    parser.add_argument("--shared-workers", action="store_true",
                        help="start the workers once and run every turn in them (single on rank 0): the "
                             "start-up is paid once; the processes are warm and shared, so not for results")
    parser.add_argument("--json", action="store_true", help="print the summary and every round as JSON")
    args = parser.parse_args(argv)
    if args.np < 2 or args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("need -np >= 2, --rounds >= 1, --iters >= 1 and --warmup >= 0")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.np)
    batch = args.batch_size or BATCH.get(args.model, 16)
    cfg = Config(args.model, batch, args.image_size, args.warmup, args.iters, threads, args.fp16_allreduce)
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(CONTENDERS))
    if unknown:
        parser.error(f"--only: unknown contender(s) {unknown}; choose from {','.join(CONTENDERS)}")

    hora_env = {}
    for item in args.hora_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--hora-env takes NAME=VALUE, got {item!r}")
        hora_env[key] = value

    def note(text: str) -> None:
        print(f"# {text}", file=sys.stderr if args.json else sys.stdout, flush=True)

    if hora_env:
        note("hora workers' extra environment: " + " ".join(f"{k}={v}" for k, v in hora_env.items()))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS if name in wanted}

    def report(round_index: int, name: str, result: dict[str, float], took: str) -> None:
        runs[name].append(result)
        note(f"round {round_index + 1}/{args.rounds}: {name:<6} {result['img_sec_total']:8.1f} img/sec total "
             f"({result['workers']} worker(s), final loss {result['loss']:.3f}; {took})")

    if args.shared_workers:
        turns = [(round_index, name) for round_index in range(args.rounds) for name in runs]
        started = time.monotonic()
        rows = run_shared([name for _, name in turns], cfg, args.np, hora_env)
        for (round_index, name), result in zip(turns, rows):
            report(round_index, name, result, "shared workers")
        note(f"all {len(turns)} turns in one job: {time.monotonic() - started:.1f} s with start-up")
    else:
        for round_index in range(args.rounds):
            for name in runs:
                started = time.monotonic()
                result = run_contender(name, cfg, args.np, hora_env)
                report(round_index, name, result, f"{time.monotonic() - started:.1f} s with start-up")
    summary = summarise(runs, args.np)
    if args.json:
        print(json.dumps({"config": asdict(cfg), "np": args.np, "rounds": args.rounds, "hora_env": hora_env,
                          "shared_workers": args.shared_workers, "summary": summary, "runs": runs}, indent=1))
    else:
        print(format_report(summary, cfg, args.np, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
