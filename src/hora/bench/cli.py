"""``hora bench``: an nccl-tests style table of collective latency and bandwidth.

Outside a hora job it launches ``-np`` local workers itself (through :func:`hora.run`); started by
``hora run -np N hora bench ...`` (``HORA_RANK`` set) it runs in place and rank 0 prints.

    hora bench -np 2 --ops allreduce -b 4 -e 64M -f 2
    hora bench -np 4 --dtype bfloat16 --json > allreduce.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hora.bench.api import API_OPS, API_SUBJECTS, APIS, api_worker, run_api_job
from hora.bench.sweep import (
    DEFAULT_ITERS,
    DEFAULT_WARMUP,
    OPS,
    BenchSpec,
    bench_worker,
    parse_dtype,
    parse_size,
    run_job,
    size_sweep,
)
from hora.errors import HoraError
from hora.workers import identity

COLUMNS = (
    # (header, row key, width, format)
    ("size(B)", "size", 12, "{:d}"),
    ("count", "count", 12, "{:d}"),
    ("type", "dtype", 9, "{}"),
    ("time(us)", "time_us", 11, "{:.2f}"),
    ("algbw(GB/s)", "algbw", 12, "{:.3f}"),
    ("busbw(GB/s)", "busbw", 12, "{:.3f}"),
    ("iters", "iters", 6, "{:d}"),
)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ops_arg(text: str) -> tuple[str, ...]:
    ops = tuple(op.strip().lower() for op in text.split(",") if op.strip())
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"unknown collective(s) {unknown or text!r}; choose from {','.join(OPS)}")
    return ops


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from hora.transport import TRANSPORTS

    parser = argparse.ArgumentParser(
        prog="hora bench",
        description="Collective latency and bandwidth over a size sweep (nccl-tests style). "
        "time: the slowest rank's mean per call after warm-up; algbw = size/time; "
        "busbw = algbw x (allreduce 2(n-1)/n, allgather/reducescatter/alltoall (n-1)/n, broadcast 1).",
    )
    parser.add_argument("-np", "--num-proc", dest="np", type=_positive_int, default=2,
                        help="workers to launch (default 2; ignored inside a hora job)")
    parser.add_argument("--ops", type=_ops_arg, default=OPS,
                        help=f"comma-separated collectives (default {','.join(OPS)})")
    parser.add_argument("-b", "--min-bytes", type=_size_arg, default=4, help="smallest size (default 4)")
    parser.add_argument("-e", "--max-bytes", type=_size_arg, default=parse_size("64M"),
                        help="largest size, K/M/G suffixes allowed (default 64M)")
    parser.add_argument("-f", "--step-factor", type=float, default=2.0, help="size multiplier (default 2)")
    parser.add_argument("--dtype", default="float32", help="element type (default float32)")
    parser.add_argument("--iters", type=_positive_int, default=DEFAULT_ITERS,
                        help=f"timed calls per size (default {DEFAULT_ITERS}; fewer for big sizes)")
    parser.add_argument("--warmup", type=_nonneg_int, default=DEFAULT_WARMUP,
                        help=f"untimed calls before timing (default {DEFAULT_WARMUP}; fewer for big sizes)")
    parser.add_argument("--transport", default="auto", choices=["auto", *sorted(TRANSPORTS)],
                        help="transport to measure (default auto: what init() picks, i.e. shared memory "
                             "within one host, TCP across hosts)")
    parser.add_argument("--api", default="transport", choices=list(APIS),
                        help="what to time: transport (default: the communicator on its own buffers, every "
                             "collective) or the public allreduce/allreduce_ on NumPy arrays (numpy), CPU "
                             "torch tensors (torch) or CUDA torch tensors (torch-cuda: NCCL's busbw on a GPU "
                             "machine), through the engine")
    parser.add_argument("--unnamed", action="store_true",
                        help="with --api: call without a name, as scripts averaging a metric do (each call is "
                             "then negotiated by name; named calls are served by the response cache)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of row objects instead of tables")
    return parser


def spec_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchSpec:
    try:
        parse_dtype(args.dtype)
        sizes = size_sweep(args.min_bytes, args.max_bytes, args.step_factor)
        if args.unnamed and args.api == "transport":
            raise ValueError("--unnamed needs --api numpy|torch|torch-cuda (the transport sweep has no names)")
        return BenchSpec(sizes=tuple(sizes), ops=tuple(args.ops), dtype=args.dtype, iters=args.iters,
                         warmup=args.warmup, transport=args.transport, unnamed=args.unnamed)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def format_tables(rows: Sequence[dict[str, Any]], spec: BenchSpec, api: str = "transport") -> str:
    """One nccl-tests style table per collective."""
    ranks = rows[0]["ranks"] if rows else "?"
    through = "" if api == "transport" else f", public API on {API_SUBJECTS[api]}"
    if spec.unnamed:
        through += ", unnamed calls"
    lines = [
        f"# hora bench: transport {spec.transport}{through}, {ranks} ranks, dtype {spec.dtype}",
        "# time: slowest rank's mean per call after warm-up; GB/s = 1e9 bytes/s;",
        "# busbw = algbw x allreduce 2(n-1)/n | allgather, reducescatter, alltoall (n-1)/n | broadcast 1",
    ]
    header = "".join(title.rjust(width + 1) for title, _, width, _ in COLUMNS)
    for op in (spec.ops if api == "transport" else [op for op in API_OPS if any(r["op"] == op for r in rows)]):
        lines += ["#", f"# {op}", "#" + header[1:]]
        for row in rows:
            if row["op"] == op:
                lines.append("".join(fmt.format(row[key]).rjust(width + 1) for _, key, width, fmt in COLUMNS))
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """``hora bench ARGS``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    spec = spec_from_args(args, parser)
    if args.api != "transport":
        if spec.ops != OPS and any(op != "allreduce" for op in spec.ops):
            parser.error(f"--api {args.api} times allreduce and allreduce_ only; drop --ops or use --ops allreduce")
        spec = replace(spec, ops=("allreduce",))
    try:
        if identity.is_worker():  # already a worker of a hora job: measure in place
            rows = bench_worker(spec) if args.api == "transport" else api_worker(spec, args.api)
            if rows is None:  # not rank 0: rank 0 reports
                return 0
        elif args.api == "transport":
            rows = run_job(spec, args.np)
        else:
            rows = run_api_job(spec, args.api, args.np)
    except HoraError as exc:
        print(f"hora bench: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_tables(rows, spec, args.api))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
