#!/usr/bin/env python
"""The GPU suite: everything a lent GPU machine should prove about hora, in one command.

    PYTHONPATH=src python benchmarks/gpu_suite.py --out DIR

writes ``DIR/gpu_suite.json`` and ``DIR/gpu_suite.md`` (the table docs/gpu.md keeps). The steps, each
in its own process group with its own time limit, so that one hang costs only its own step:

1. ``tests``: the GPU tests (tests/nccl, tests/hora_torch/test_torch_cuda.py; the TF and JAX device
   tests are in tests/nccl and run where those frameworks see the GPU);
2. ``np1``: ResNet-50 on synthetic data, batch 64, fp32 and AMP bf16: ``hora.torch`` with NCCL at
   ``-np 1`` against plain PyTorch in the same process, taking turns round after round (bar: within 3%);
3. ``np2_host``: two ranks sharing the GPU, hora staging through host memory (``HORA_NCCL=off``)
   against DDP over Gloo on the CUDA tensors, taking turns in one job;
4. ``bench``: ``hora bench --api torch-cuda`` allreduce from 4 B to 256 MiB;
5. ``killed_peer``: one of two ranks SIGKILLed during CUDA allreduces: how long until the survivor
   raised (bar: 10 s);
6. ``two_ranks_auto``: two ranks on one GPU with the default ``HORA_NCCL=auto``: what a user who
   tries it sees (NCCL refuses two ranks of a communicator on one device).

Without a CUDA GPU it refuses in one line and exits 2. Figures are the median over rounds; the
machine's other tenants are unknown, so each comparison is made side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: Each step's own limit in seconds; the suite as a whole stops starting steps past SUITE_LIMIT_S.
STEP_LIMITS = {"tests": 240, "np1": 180, "np2_host": 150, "bench": 120, "killed_peer": 90, "two_ranks_auto": 60}
SUITE_LIMIT_S = 420
NP1_BAR = 0.97  # hora -np 1 images/s over plain PyTorch's
KILL_BAR_S = 10.0
GPU_TESTS = ["tests/nccl", "tests/hora_torch/test_torch_cuda.py"]

_PROBE = """
import json, sys
out = {"available": False}
try:
    import torch
except ImportError as exc:
    out["why"] = f"torch is not installed ({exc})"
else:
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out.update(available=True, count=torch.cuda.device_count(), name=torch.cuda.get_device_name(0))
    else:
        out["why"] = ("this torch build has no CUDA" if torch.version.cuda is None
                      else "torch.cuda.is_available() is False")
print(json.dumps(out))
"""


def probe_gpu() -> dict[str, Any]:
    """What CUDA torch sees, from a child process (the suite's own process never initialises CUDA)."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"available": False, "why": f"the probe failed: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the steps, each run in a child process (``--step NAME``) ---------------------------------


def step_tests(out: str, gpu: dict[str, Any]) -> dict[str, Any]:
    junit = os.path.join(out, "gpu_tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={junit}", *GPU_TESTS]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    with open(os.path.join(out, "gpu_tests.log"), "w") as handle:
        handle.write(done.stdout + done.stderr)
    counts = junit_counts(junit)
    return {**counts, "ok": counts["failed"] == 0 and counts["errors"] == 0 and counts["passed"] > 0,
            "summary": (done.stdout.strip().splitlines() or [""])[-1]}


def junit_counts(path: str) -> dict[str, Any]:
    """Passed, failed, errors and skipped of a junit file, with the names of what did not pass."""
    import xml.etree.ElementTree as ElementTree

    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "not_passed": []}
    for case in ElementTree.parse(path).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped", None: "passed"}[outcome]
        counts[key] += 1
        if outcome in ("failure", "error"):
            counts["not_passed"].append(f"{case.get('classname')}::{case.get('name')}")
    return counts


def step_np1(out: str, gpu: dict[str, Any]) -> dict[str, Any]:
    from gpu_workers import TrainConfig, train

    import hora

    cfg = TrainConfig(modes=("plain", "hora"), precisions=("fp32", "bf16"))
    [measured] = hora.run(train, args=(cfg,), np=1, start_timeout=120)
    rows = throughput_rows(measured["seconds"], cfg.batch * cfg.steps, ranks=1)
    add_cpu(rows, measured, cfg.steps)
    ratios = {p: ratio(rows, f"hora/{p}", f"plain/{p}") for p in cfg.precisions}
    return {"rows": rows, "ratios": ratios, "bar": NP1_BAR, "config": vars(cfg),
            "ok": all(r is not None and r >= NP1_BAR for r in ratios.values())}


def step_np2_host(out: str, gpu: dict[str, Any]) -> dict[str, Any]:
    from gpu_workers import TrainConfig, train

    import hora

    cfg = TrainConfig(modes=("hora", "ddp"), steps=20, ddp_port=free_port())
    env = {"HORA_NCCL": "off", "GLOO_SOCKET_IFNAME": "lo"}
    per_rank = hora.run(train, args=(cfg,), np=2, env=env, start_timeout=120)
    seconds = [measured["seconds"] for measured in per_rank]
    slowest = {key: [max(times) for times in zip(*(r[key] for r in seconds))] for key in seconds[0]}
    rows = throughput_rows(slowest, cfg.batch * cfg.steps, ranks=2)
    add_cpu(rows, per_rank[0], cfg.steps)  # rank 0's
    return {"rows": rows, "ratios": {"fp32": ratio(rows, "hora/fp32", "ddp/fp32")}, "config": vars(cfg),
            "ok": True}


def step_bench(out: str, gpu: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hora", "bench", "--api", "torch-cuda", "-np", "1", "--ops", "allreduce",
           "-b", "4", "-e", "256M", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"ok": False, "error": last_line(done.stderr)}
    rows = [{key: row[key] for key in ("op", "size", "time_us", "algbw", "busbw", "iters")}
            for row in json.loads(done.stdout)]
    return {"ok": bool(rows), "rows": rows}


def step_killed_peer(out: str, gpu: dict[str, Any]) -> dict[str, Any]:
    from gpu_workers import killed_peer

    import hora

    env = {"HORA_NCCL": "off"} if gpu.get("count", 1) < 2 else {}
    with tempfile.TemporaryDirectory() as folder:
        try:
            hora.run(killed_peer, args=(folder, 64 << 20), np=2, env=env, kill_grace=30, start_timeout=120)
            raised = None
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        records = {}
        for rank in (0, 1):
            path = os.path.join(folder, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as handle:
                    records[rank] = json.load(handle)
            else:
                records[rank] = None
    victim, survivor = records[1], records[0]
    delay = (survivor["raised_at"] - victim["died_at"]
             if survivor and victim and survivor.get("raised_at") else None)
    return {"ok": delay is not None and delay <= KILL_BAR_S, "seconds_to_raise": delay, "bar": KILL_BAR_S,
            "survivor": survivor, "launcher": raised, "path": "host staging" if env else "NCCL"}


def step_two_ranks_auto(out: str, gpu: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hora", "bench", "--api", "torch-cuda", "-np", "2", "--ops", "allreduce",
           "-b", "4", "-e", "4", "--iters", "2", "--warmup", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return {"ok": None, "returncode": done.returncode, "said": last_line(done.stderr) or last_line(done.stdout)}


STEPS: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {
    "tests": step_tests, "np1": step_np1, "np2_host": step_np2_host, "bench": step_bench,
    "killed_peer": step_killed_peer, "two_ranks_auto": step_two_ranks_auto,
}


# ---- arithmetic and the report ----------------------------------------------------------------


def throughput_rows(seconds: dict[str, list[float]], images_per_rank: int, ranks: int) -> dict[str, dict[str, float]]:
    """Images per second (all ranks together) per contender: the median round, and the spread."""
    rows = {}
    for key, times in seconds.items():
        rates = [images_per_rank * ranks / t for t in times]
        rows[key] = {"images_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                     "rounds": len(rates)}
    return rows


def add_cpu(rows: dict[str, dict[str, float]], measured: dict[str, dict[str, list[float]]], steps: int) -> None:
    """CPU milliseconds per step (median round): the whole process, and its main thread alone."""
    for key, row in rows.items():
        for what in ("process_cpu", "thread_cpu"):
            if key in measured.get(what, {}):
                row[f"{what}_ms"] = 1000 * statistics.median(measured[what][key]) / steps


def ratio(rows: dict[str, dict[str, float]], a: str, b: str) -> float | None:
    if a not in rows or b not in rows or not rows[b]["images_per_s"]:
        return None
    return rows[a]["images_per_s"] / rows[b]["images_per_s"]


def verdict(ok: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "(information)"}[ok]


def format_markdown(report: dict[str, Any]) -> str:
    """The table docs/gpu.md keeps: one section per step, figures as the run produced them."""
    gpu = report["gpu"]
    lines = [f"### {report['date']}: {gpu.get('name', '?')} (torch {gpu.get('torch')}, CUDA {gpu.get('cuda')})",
             "", f"Suite {verdict(report['ok'])} in {report['seconds']:.0f} s.", "",
             "| step | result | seconds | detail |", "| --- | --- | --- | --- |"]
    for name, step in report["steps"].items():
        lines.append(f"| {name} | {verdict(step.get('ok'))} | {step.get('step_seconds', 0):.0f} | "
                     f"{step_detail(name, step)} |")
    for name in ("np1", "np2_host"):
        rows = report["steps"].get(name, {}).get("rows")
        if rows:
            lines += ["", f"{name}: images/s, all ranks together (median of rounds, min-max); CPU ms per step "
                      "(rank 0: whole process / main thread)", "",
                      "| contender | images/s | min | max | CPU ms/step |", "| --- | --- | --- | --- | --- |"]
            lines += [f"| {key} | {row['images_per_s']:.1f} | {row['min']:.1f} | {row['max']:.1f} | "
                      f"{cpu_cell(row)} |" for key, row in rows.items()]
    rows = report["steps"].get("bench", {}).get("rows")
    if rows:
        lines += ["", "bench: hora bench --api torch-cuda -np 1 (allreduce: a new tensor; allreduce_: in place; "
                  "each call waits for the GPU)", "",
                  "| call | size (B) | time (us) | algbw (GB/s) |", "| --- | --- | --- | --- |"]
        lines += [f"| {row.get('op', '?')} | {row['size']} | {row['time_us']:.1f} | {row['algbw']:.2f} |"
                  for row in rows]
    return "\n".join(lines) + "\n"


def cpu_cell(row: dict[str, float]) -> str:
    if "process_cpu_ms" not in row:
        return "-"
    return f"{row['process_cpu_ms']:.1f} / {row.get('thread_cpu_ms', float('nan')):.1f}"


def step_detail(name: str, step: dict[str, Any]) -> str:
    if "error" in step:
        return str(step["error"]).replace("|", "/")
    if name == "tests":
        failed = ", ".join(step.get("not_passed", [])[:5])
        return (f"{step['passed']} passed, {step['failed']} failed, {step['errors']} errors, "
                f"{step['skipped']} skipped" + (f": {failed}" if failed else ""))
    if name in ("np1", "np2_host"):
        against = "plain PyTorch" if name == "np1" else "DDP (Gloo)"
        return ", ".join(f"{p}: hora/{against} {r:.3f}" if r is not None else f"{p}: no ratio"
                         for p, r in step.get("ratios", {}).items())
    if name == "bench":
        return f"{len(step.get('rows', []))} sizes"
    if name == "killed_peer":
        seconds = step.get("seconds_to_raise")
        said = (step.get("survivor") or {}).get("type", "no record")
        return (f"survivor raised {said} after {seconds:.2f} s ({step.get('path')})" if seconds is not None
                else f"survivor did not raise ({said}; launcher: {step.get('launcher')})")
    if name == "two_ranks_auto":
        return f"exit {step.get('returncode')}: {step.get('said')}".replace("|", "/")
    return ""


# ---- running ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


def run_step(name: str, out: str, gpu: dict[str, Any], limit: float) -> dict[str, Any]:
    """One step in a child process group; on its time limit the whole group is killed."""
    result_path = os.path.join(out, f"step_{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--step", name, "--out", out, "--gpu", json.dumps(gpu)]
    start = time.monotonic()
    with open(os.path.join(out, f"step_{name}.log"), "w") as log:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return {"ok": False, "error": f"no result within its {limit:.0f} s limit", "step_seconds": limit}
    took = time.monotonic() - start
    if not os.path.exists(result_path):
        with open(os.path.join(out, f"step_{name}.log")) as log:
            return {"ok": False, "error": f"exit {child.returncode}: {last_line(log.read())}", "step_seconds": took}
    with open(result_path) as handle:
        return {**json.load(handle), "step_seconds": took}


def child_main(name: str, out: str, gpu: dict[str, Any]) -> int:
    try:
        result = STEPS[name](out, gpu)
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:400]}
    with open(os.path.join(out, f"step_{name}.json"), "w") as handle:
        json.dump(result, handle, indent=1, default=str)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_suite_out", help="folder for gpu_suite.json/.md and the logs")
    parser.add_argument("--only", default=",".join(STEPS), help="comma-separated steps to run, in order")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # a child: run one step
    parser.add_argument("--gpu", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # Workers started by hora.run import gpu_workers and hora from here.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (HERE, os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, HERE)
    if args.step:
        return child_main(args.step, args.out, json.loads(args.gpu))
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}; the steps are {', '.join(STEPS)}")
    gpu = probe_gpu()
    if not gpu.get("available"):
        print(f"gpu_suite: needs a CUDA GPU, and there is none here: {gpu.get('why')}", file=sys.stderr)
        return 2
    start = time.monotonic()
    steps: dict[str, Any] = {}
    for name in names:
        left = SUITE_LIMIT_S - (time.monotonic() - start)
        if left < 20:
            steps[name] = {"ok": False, "error": f"not run: the suite's {SUITE_LIMIT_S} s were spent"}
            continue
        steps[name] = run_step(name, args.out, gpu, min(STEP_LIMITS[name], left))
        print(f"gpu_suite: {name}: {verdict(steps[name].get('ok'))} ({step_detail(name, steps[name])})",
              flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "seconds": time.monotonic() - start, "steps": steps,
              "ok": all(step.get("ok") is not False for step in steps.values())}
    with open(os.path.join(args.out, "gpu_suite.json"), "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    markdown = format_markdown(report)
    with open(os.path.join(args.out, "gpu_suite.md"), "w") as handle:
        handle.write(markdown)
    print(markdown)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
