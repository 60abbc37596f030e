"""``hora timeline TRACE``: where a job's collective time went, read from its Chrome-trace timeline.

The trace (written by rank 0, see ``hora.engine.timeline``) holds, per tensor, a negotiation span
with a mark per rank as each reported the tensor ready, then the operation's span with its queue,
fusion-copy and transport activities nested inside. A perfectly balanced job spends almost nothing
in negotiation; time there is time the ranks waited for each other, and the rank that keeps
arriving last is the straggler the summary names.

The summary accounts for all of rank 0's traced time (the first span's start to the last one's end),
each instant once: tensors overlap (fused tensors share one transport run, one tensor negotiates while
another's bytes move), so an instant goes to the busiest thing any tensor was doing then, and time in
no hora phase gets a row of its own. Waits are wall-clock too: negotiations that wait for the same
late rank at the same time are one wait, not one per tensor.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hora.engine.request import Kind

#: The share of last arrivals that makes a rank the straggler (see TimelineSummary.straggler).
STRAGGLER_SHARE = 0.75
PHASES = ("negotiation", "queue", "fusion copies", "communication")
#: Inside an operation's span but in none of its activities: scheduling, scaling, handing results back.
OTHER = "other hora work"
#: No tensor in any hora phase or operation: the script's own work, or nothing at all.
OUTSIDE = "outside hora"
#: The breakdown's rows: together they are the whole traced time.
ROWS = PHASES + (OTHER, OUTSIDE)
#: An instant in which tensors are in different phases counts for the first of these any tensor is in:
#: work before waiting, so a negotiation that waits while another tensor's bytes move costs nothing.
PRECEDENCE = ("communication", "fusion copies", OTHER, "queue", "negotiation")
_COPIES = ("MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER")
_OPERATIONS = frozenset(kind.value for kind in Kind)


@dataclass
class TensorTimes:
    """Per-tensor microseconds in each phase and the number of operations seen."""

    name: str
    ops: int = 0
    phase_us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def total_us(self) -> float:
        return sum(self.phase_us.values())


@dataclass
class RankWaits:
    """How often a rank arrived last to a negotiation and how long rank 0 saw the others wait: the
    wall-clock union of those waits (several tensors waiting for it at once are one wait)."""

    last_arrivals: int = 0
    waited_for_us: float = 0.0


@dataclass
class TimelineSummary:
    tensors: dict[str, TensorTimes]
    #: Per phase, the wall-clock time some tensor was in it (phases overlap one another).
    phase_wall_us: dict[str, float]
    span_us: float
    negotiations: int
    decided: int  # negotiations in which a single group of late ranks could be told apart
    ranks: dict[int, RankWaits]
    #: Each step's microseconds per row of :data:`ROWS`, summing to the step's length. Steps start
    #: where the tensor operated on most often (once a step in a training loop) starts an operation.
    steps: list[dict[str, float]] = field(default_factory=list)
    #: The traced time per row of :data:`ROWS`, each instant counted once (see :data:`PRECEDENCE`):
    #: the rows sum to ``span_us``.
    breakdown_us: dict[str, float] = field(default_factory=dict)

    @property
    def most_often_last(self) -> tuple[int, float] | None:
        """The rank that arrived last most often and its share of the negotiations that could tell
        (ties: the one waited for longest)."""
        if not self.ranks or self.decided == 0:
            return None
        rank, waits = max(self.ranks.items(), key=lambda kv: (kv[1].last_arrivals, kv[1].waited_for_us))
        return rank, waits.last_arrivals / self.decided

    @property
    def straggler(self) -> int | None:
        """The rank that arrived last in at least 3 of 4 negotiations that could tell: in a balanced
        job the last arrival moves between ranks (about half each with 2 ranks)."""
        found = self.most_often_last
        return found[0] if found is not None and found[1] >= STRAGGLER_SHARE else None


# ---- reading ------------------------------------------------------------------------------------


def load_events(path: str) -> list[dict]:
    """The trace's events; a clear ``ValueError`` when the file is not a Chrome trace."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a JSON trace: {exc}") from None
    if isinstance(data, dict):
        data = data.get("traceEvents", [])
    if not isinstance(data, list) or any(not isinstance(e, dict) for e in data):
        raise ValueError(f"{path} is not a Chrome trace (expected a list of event objects)")
    return data


def _spans(events: Iterable[dict]) -> tuple[dict[int, str], list[tuple[int, str, float, float, dict, list]]]:
    """Balanced (pid, event name) spans with their begin args and the rank marks inside them."""
    names: dict[int, str] = {}
    open_spans: dict[tuple[int, str], list[list]] = defaultdict(list)
    marks: dict[int, list[tuple[float, str]]] = defaultdict(list)
    spans = []
    for e in events:
        ph = e.get("ph")
        pid: Any = e.get("pid")  # the trace's JSON, untyped
        if ph == "M" and e.get("name") == "process_name":
            names[pid] = str(e.get("args", {}).get("name", pid))
        elif ph == "B":
            open_spans[(pid, e["name"])].append([e["ts"], e.get("args") or {}, len(marks[pid])])
        elif ph == "E":
            stack = open_spans.get((pid, e["name"]))
            if stack:
                begin, args, first_mark = stack.pop()
                inside = marks[pid][first_mark:] if e["name"].startswith("NEGOTIATE_") else []
                spans.append((pid, e["name"], float(begin), float(e["ts"]), args, inside))
        elif ph == "i" and e.get("s") == "p":
            marks[pid].append((float(e["ts"]), e["name"]))
    return names, spans


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The same instants as sorted, disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for b, e in sorted(intervals):
        if e <= b:
            continue
        if merged and b <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((b, e))
    return merged


def _union_us(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(e - b for b, e in _merged(intervals))


def _minus(intervals: list[tuple[float, float]],
           holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` without the instants in ``holes`` (both sorted and disjoint, as :func:`_merged`
    gives them)."""
    left, k = [], 0
    for b, e in intervals:
        while k < len(holes) and holes[k][1] <= b:
            k += 1
        j = k
        while j < len(holes) and holes[j][0] < e:
            if holes[j][0] > b:
                left.append((b, holes[j][0]))
            b = max(b, holes[j][1])
            j += 1
        if e > b:
            left.append((b, e))
    return left


def _breakdown_segments(intervals: dict[str, list[tuple[float, float]]], lo: float,
                        hi: float) -> list[tuple[float, float, str]]:
    """[lo, hi] cut into consecutive pieces, each labelled with the row its instants count for: the
    first phase of :data:`PRECEDENCE` some tensor is in, else :data:`OUTSIDE`."""
    edges = sorted((t, step, row) for row, spans in intervals.items() for b, e in spans if e > b
                   for t, step in ((b, 1), (e, -1)))
    active = dict.fromkeys(PRECEDENCE, 0)
    segments: list[tuple[float, float, str]] = []
    at, i = lo, 0
    while at < hi:
        upto = edges[i][0] if i < len(edges) else hi
        if upto > at:
            row = next((p for p in PRECEDENCE if active[p] > 0), OUTSIDE)
            if segments and segments[-1][2] == row:
                at = segments.pop()[0]
            segments.append((at, upto, row))
            at = upto
        while i < len(edges) and edges[i][0] == upto:
            active[edges[i][2]] += edges[i][1]
            i += 1
    return segments


def _late_ranks(begin: float, end: float, args: dict,
                inside: list) -> tuple[list[int], tuple[float, float] | None]:
    """The ranks that arrived last to one negotiation, and when the earliest waited for them (None
    when the trace cannot tell)."""
    if args.get("cached"):
        late = [int(r) for r in args.get("late", [])]
        members = int(args.get("members", 0))
        if not late or len(late) >= members:
            return [], None  # everyone (or no one known) arrived in the deciding cycle
        own = [int(n) for t, n in inside if t == begin]
        return late, (begin, end) if own and own[0] not in late and end > begin else None
    arrivals: dict[int, float] = {}
    for t, rank in inside:
        if rank.isdigit():
            arrivals[int(rank)] = max(arrivals.get(int(rank), t), t)
    if len(arrivals) < 2:
        return [], None
    first, last = min(arrivals.values()), max(arrivals.values())
    if last <= first:
        return [], None
    return [r for r, t in arrivals.items() if t == last], (first, last)


def summarize(events: Sequence[dict]) -> TimelineSummary:
    names, spans = _spans(events)
    tensors: dict[str, TensorTimes] = {}
    intervals: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
    operations: dict[int, list[tuple[float, float]]] = defaultdict(list)  # per tensor: its operations'
    activities: dict[int, list[tuple[float, float]]] = defaultdict(list)  # ... and its phases' spans
    ranks: dict[int, RankWaits] = defaultdict(RankWaits)
    waits: dict[int, list[tuple[float, float]]] = defaultdict(list)
    by_pid: dict[int, list] = defaultdict(list)
    op_begins: dict[str, list[float]] = defaultdict(list)
    negotiations = decided = 0
    lo, hi = float("inf"), float("-inf")
    for span in spans:
        by_pid[span[0]].append(span)
    for pid, pid_spans in by_pid.items():
        times = tensors.setdefault(names.get(pid, str(pid)), TensorTimes(names.get(pid, str(pid))))
        for _, event, begin, end, args, inside in pid_spans:
            lo, hi = min(lo, begin), max(hi, end)
            if event.startswith("NEGOTIATE_"):
                phase = "negotiation"
                negotiations += 1
                late, waited = _late_ranks(begin, end, args, inside)
                if late:
                    decided += 1
                    for rank in late:
                        ranks[rank].last_arrivals += 1
                        if waited is not None:
                            waits[rank].append(waited)
            elif event == "QUEUE":
                phase = "queue"
            elif event in _COPIES:
                phase = "fusion copies"
            elif _is_operation(event):
                times.ops += 1
                op_begins[times.name].append(begin)
                operations[pid].append((begin, end))
                continue  # the operation's own span encloses its activities
            else:
                phase = "communication"
            times.phase_us[phase] += end - begin
            intervals[phase].append((begin, end))
            if phase != "negotiation":
                activities[pid].append((begin, end))
    for rank, spans_waited in waits.items():
        ranks[rank].waited_for_us = _union_us(spans_waited)
    # hora's work inside an operation but in none of its phases, tensor by tensor
    other = [gap for pid, ops in operations.items() for gap in _minus(_merged(ops), _merged(activities[pid]))]
    if not spans:
        lo = hi = 0.0
    segments = _breakdown_segments({**intervals, OTHER: other}, lo, hi)
    breakdown = dict.fromkeys(ROWS, 0.0)
    for b, e, row in segments:
        breakdown[row] += e - b
    return TimelineSummary(tensors=tensors, phase_wall_us={p: _union_us(v) for p, v in intervals.items()},
                           span_us=hi - lo, negotiations=negotiations, decided=decided, ranks=dict(ranks),
                           steps=_steps(op_begins, segments, hi), breakdown_us=breakdown)


def _steps(op_begins: dict[str, list[float]], segments: list[tuple[float, float, str]],
           end: float) -> list[dict[str, float]]:
    """Each step's share of the breakdown's ``segments`` (consecutive, as :func:`_breakdown_segments`
    gives), per row."""
    if not op_begins:
        return []
    _, marks = max(op_begins.items(), key=lambda kv: (len(kv[1]), kv[0]))
    marks = sorted(marks)
    if len(marks) < 2:
        return []
    starts = [b for b, _, _ in segments]
    steps = []
    for lo, hi in zip(marks, marks[1:] + [end]):
        step = dict.fromkeys(ROWS, 0.0)
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        while k < len(segments) and segments[k][0] < hi:
            b, e, row = segments[k]
            step[row] += max(0.0, min(e, hi) - max(b, lo))
            k += 1
        steps.append(step)
    return steps


def _is_operation(event: str) -> bool:
    """An operation's own span (ALLREDUCE, BROADCAST...; Horovod's traces name them the same way),
    as opposed to the queue, copy and transport activities nested in it."""
    return event in _OPERATIONS


# ---- printing and plotting --------------------------------------------------------------------


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def format_summary(summary: TimelineSummary, top: int = 15) -> str:
    lines = [f"timeline: {len(summary.tensors)} tensors, {summary.negotiations} negotiations, "
             f"{_ms(summary.span_us)} ms traced"]
    lines.append("")
    lines.append("where rank 0's traced time went (rank 0 writes the trace); each instant counts once, "
                 "for the")
    lines.append(f"first of {', '.join(PRECEDENCE)} that some tensor was in:")
    lines.append(f"  {'':<18}{'ms':>12}{'share':>9}   {'some tensor in it, ms':>22}")
    for row in ROWS:
        us = summary.breakdown_us.get(row, 0.0)
        share = us / summary.span_us * 100 if summary.span_us else 0.0
        overlap = _ms(summary.phase_wall_us[row]) if row in summary.phase_wall_us else "-"
        lines.append(f"  {row:<18}{_ms(us):>12}{share:>8.1f}%   {overlap:>22}")
    lines.append(f"  {'total':<18}{_ms(summary.span_us):>12}{100.0 if summary.span_us else 0.0:>8.1f}%")
    lines.append(f"  {OTHER}: in an operation, between its queue, copy and transport steps")
    lines.append(f"  {OUTSIDE}: no tensor in an operation or a negotiation (the script's own work, or idle)")
    lines.append("")
    lines.append(f"slowest tensors (of {len(summary.tensors)}), ms summed over their operations:")
    header = f"  {'tensor':<44}{'ops':>5}" + "".join(f"{p:>15}" for p in PHASES)
    lines.append(header)
    for t in sorted(summary.tensors.values(), key=lambda t: -t.total_us)[:top]:
        name = t.name if len(t.name) <= 42 else t.name[:20] + ".." + t.name[-20:]
        lines.append(f"  {name:<44}{t.ops:>5}" + "".join(f"{_ms(t.phase_us[p]):>15}" for p in PHASES))
    lines.append("")
    lines.append("waiting for ranks (negotiations where some ranks arrived after the others):")
    if not summary.decided:
        lines.append("  none: every negotiation completed with all ranks arriving together")
    for rank, waits in sorted(summary.ranks.items()):
        lines.append(f"  rank {rank}: arrived last in {waits.last_arrivals} of {summary.decided}; "
                     f"the others waited {_ms(waits.waited_for_us)} ms for it (wall clock, as far as rank 0 "
                     "can see)")
    lines.append("")
    straggler, found = summary.straggler, summary.most_often_last
    if straggler is not None and found is not None:  # a straggler is the rank found
        lines.append(f"straggler: rank {straggler} (last to arrive in {found[1]:.0%} of the "
                     f"{summary.decided} negotiations that could tell)")
    elif found is not None:
        lines.append(f"straggler: none stands out (most often last: rank {found[0]}, {found[1]:.0%}; "
                     f"a straggler is last in {STRAGGLER_SHARE:.0%} or more)")
    else:
        lines.append("straggler: none (no negotiation had late ranks)")
    return "\n".join(lines)


def plot_summary(summary: TimelineSummary, out_path: str, top: int = 15) -> None:
    """A per-tensor phase breakdown and a per-rank waiting chart, in one PNG."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'hora[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensors = sorted(summary.tensors.values(), key=lambda t: -t.total_us)[:top]
    fig, (steps_ax, left, right) = plt.subplots(
        1, 3, figsize=(18, max(4, 0.35 * len(tensors) + 2)), gridspec_kw={"width_ratios": [2, 3, 1]})
    _stacked_steps(steps_ax, summary.steps)
    labels = [t.name if len(t.name) <= 40 else t.name[:18] + ".." + t.name[-18:] for t in tensors]
    starts = [0.0] * len(tensors)
    for phase in PHASES:
        values = [t.phase_us[phase] / 1000 for t in tensors]
        left.barh(labels, values, left=starts, label=phase)
        starts = [s + v for s, v in zip(starts, values)]
    left.invert_yaxis()
    left.set_xlabel("ms (summed over the tensor's operations)")
    left.set_title("where each tensor's time went")
    left.legend(loc="lower right")
    ranks = sorted(summary.ranks)
    right.bar([str(r) for r in ranks], [summary.ranks[r].waited_for_us / 1000 for r in ranks], color="tab:red")
    right.set_xlabel("rank")
    right.set_ylabel("ms the others waited for it")
    title = "waiting per rank"
    if summary.straggler is not None:
        title += f" (straggler: rank {summary.straggler})"
    right.set_title(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def _stacked_steps(ax, steps: list[dict[str, float]], most: int = 60) -> None:
    """Per-step time in each row of the breakdown (an even sample of at most ``most`` steps): each bar
    is the whole step, as the rows partition it."""
    if not steps:
        ax.text(0.5, 0.5, "no repeated operation: no steps to show", ha="center", va="center")
        ax.set_axis_off()
        return
    picked = list(range(len(steps)))
    if len(picked) > most:
        picked = [round(i * (len(steps) - 1) / (most - 1)) for i in range(most)]
    bottoms = [0.0] * len(picked)
    for row in ROWS:
        values = [steps[i][row] / 1000 for i in picked]
        ax.bar([str(i + 1) for i in picked], values, bottom=bottoms, label=row)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xlabel("step")
    ax.set_ylabel("ms of wall-clock time")
    ax.set_title("step breakdown")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize="small")
    if len(picked) > 15:
        ax.set_xticks(ax.get_xticks()[:: max(1, len(picked) // 10)])


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hora timeline",
        description="Summarise a hora (or Horovod) timeline: time per tensor and phase, and the rank "
                    "the others waited for.")
    parser.add_argument("trace", help="the timeline file (--timeline-filename / HOROVOD_TIMELINE)")
    parser.add_argument("--top", type=int, default=15, help="tensors to list (default 15)")
    parser.add_argument("--plot", metavar="OUT.png", help="also draw the breakdown and the waiting chart")
    args = parser.parse_args(list(argv))
    try:
        summary = summarize(load_events(args.trace))
    except (OSError, ValueError) as exc:
        print(f"hora timeline: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary, args.top))
    if args.plot:
        try:
            plot_summary(summary, args.plot, args.top)
        except RuntimeError as exc:
            print(f"hora timeline: error: {exc}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 0
