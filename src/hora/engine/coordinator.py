"""The coordinator: decides which requests are ready on every rank, and checks that they agree.

It runs on the first member of each process set. Each negotiation round it receives the signatures
newly submitted on every member, and answers with an ordered list of :class:`Response` objects that
every member then executes in that order. Disagreement (shape, dtype, op, root, ...) becomes an error
response for that name on every member, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from hora.engine.request import PROCESS_SET_KINDS, Kind, Signature, signature

_FUSIBLE = (Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST)
#: Kinds whose agreement :meth:`Coordinator._disagreement` checks by comparing fields only (the others
#: also check a field's value against the set: allgather's and alltoall's shapes, broadcast's root).
_CHECKED_BY_FIELDS_ALONE = frozenset((Kind.ALLREDUCE, Kind.REDUCESCATTER, Kind.BARRIER, Kind.JOIN))


@dataclass
class Response:
    """One name's agreed collective (or its error), as every member will execute it."""

    name: str
    signature: Signature  # the coordinator's reference signature (member 0's, or the first seen)
    error: str | None = None
    rows: tuple[int, ...] = ()  # allgather: first dimension on each member
    splits: tuple[tuple[int, ...], ...] = ()  # alltoall: splits[i][j] = rows member i sends to j
    joined: tuple[int, ...] = ()  # members contributing zeros (allreduce after join)
    last_joined: int = -1  # join: the last member to join

    def __reduce__(self) -> tuple[Any, ...]:
        # Every negotiation round pickles the plan: send the fields alone, not the cached properties.
        return (Response, (self.name, self.signature, self.error, self.rows, self.splits, self.joined,
                           self.last_joined))

    # Derived facts are cached: a cached response is executed again every step.
    @cached_property
    def cacheable(self) -> bool:
        return (
            self.error is None
            and not self.joined
            and self.signature.kind not in (Kind.JOIN, Kind.BARRIER)
            and self.signature.kind not in PROCESS_SET_KINDS
        )

    @cached_property
    def fusion_key(self) -> tuple[object, ...] | None:
        """Responses with equal keys may share a fusion buffer; None: never fused."""
        sig = self.signature
        if self.error is not None or sig.kind not in _FUSIBLE:
            return None
        if sig.kind == Kind.ALLREDUCE:
            return (sig.kind, sig.dtype, sig.op, sig.prescale, sig.postscale, self.joined, sig.device)
        if sig.kind == Kind.BROADCAST:
            return (sig.kind, sig.dtype, sig.root, sig.device)
        return (sig.kind, sig.dtype, sig.device)  # allgather: tensors of any row shape fuse

    @cached_property
    def nbytes(self) -> int:
        """Bytes this response moves through a fusion buffer (allgather: all members' rows)."""
        sig = self.signature
        if sig.kind == Kind.ALLGATHER and self.rows:
            return sum(self.rows) * sig.row_count * sig.np_dtype.itemsize
        return sig.nbytes()


@dataclass
class _Pending:
    first_seen: float
    order: int
    signatures: dict[int, Signature] = field(default_factory=dict)
    warned_at: float = 0.0


@dataclass
class StallReport:
    warnings: list[str]
    fatal: str | None


class Coordinator:
    """Negotiation state of one process set; ``members`` maps member index -> global rank."""

    def __init__(self, members: list[int]) -> None:
        self.members = members
        self.size = len(members)
        self._pending: dict[str, _Pending] = {}
        self._joined: list[int] = []
        self._counter = 0

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def is_pending(self, name: str) -> bool:
        return name in self._pending

    @property
    def joined(self) -> tuple[int, ...]:
        return tuple(self._joined)

    def submit(self, member: int, signatures: list[tuple[str, Signature]], now: float | None = None) -> None:
        """Record that ``member`` has these requests ready."""
        now = time.monotonic() if now is None else now
        for name, sig in signatures:
            if sig.kind == Kind.JOIN:
                if member not in self._joined:
                    self._joined.append(member)
                continue
            entry = self._pending.get(name)
            if entry is None:
                entry = self._pending[name] = _Pending(first_seen=now, order=self._counter)
                self._counter += 1
            entry.signatures[member] = sig

    def _needed(self, entry: _Pending) -> range | list[int]:
        """The members whose request ``entry`` waits for: the non-joined ones, or every member for a
        collective that runs through join."""
        if not self._joined or next(iter(entry.signatures.values())).through_join:
            return range(self.size)
        return [m for m in range(self.size) if m not in self._joined]

    def ready(self) -> list[Response]:
        """Responses for every name now ready on all the members it needs, in first-seen order."""
        complete = {
            name
            for name, entry in self._pending.items()
            if entry.signatures and all(m in entry.signatures for m in self._needed(entry))
        }
        # A grouped collective is released only when all of its members are ready.
        groups: dict[str, list[str]] = {}
        for name in complete:
            sig = next(iter(self._pending[name].signatures.values()))
            if sig.group:
                groups.setdefault(sig.group, []).append(name)
        for names in groups.values():
            sig = next(iter(self._pending[names[0]].signatures.values()))
            if len(names) < sig.group_size:
                complete.difference_update(names)
        ordered = sorted(complete, key=lambda n: self._pending[n].order)
        responses = [self._respond(name, self._pending.pop(name)) for name in ordered]
        if self._joined and len(self._joined) == self.size:
            last = self._joined[-1]
            self._joined.clear()
            join_sig = signature(Kind.JOIN, "uint8", ())
            responses.append(Response("__join__", join_sig, last_joined=last))
        return responses

    def _respond(self, name: str, entry: _Pending) -> Response:
        sigs = entry.signatures
        members = sorted(sigs)
        ref = sigs[members[0]]
        joined = () if ref.through_join else tuple(self._joined)
        error = self._disagreement(name, sigs)
        if error is None and joined and ref.kind != Kind.ALLREDUCE:
            error = (
                f"{ref.kind.value} of tensor {name!r} while ranks {[self.members[j] for j in joined]} "
                "have joined; only allreduce supports join"
            )
        if error is None and joined and ref.device:
            error = (
                f"{ref.kind.value} of CUDA tensor {name!r} on the NCCL path while ranks "
                f"{[self.members[j] for j in joined]} have joined: a joined rank has no device buffer to "
                "contribute; set HORA_NCCL=off to reduce CUDA tensors through host memory with join"
            )
        if error is not None:
            return Response(name, ref, error=error)
        rows: tuple[int, ...] = ()
        splits: tuple[tuple[int, ...], ...] = ()
        if ref.kind == Kind.ALLGATHER:
            rows = tuple(sigs[m].shape[0] for m in range(self.size))
        elif ref.kind == Kind.ALLTOALL:
            splits = tuple(sigs[m].splits for m in range(self.size))
        return Response(name, ref, rows=rows, splits=splits, joined=joined)

    def _disagreement(self, name: str, sigs: dict[int, Signature]) -> str | None:
        members = sorted(sigs)
        ref = sigs[members[0]]
        if ref.kind in _CHECKED_BY_FIELDS_ALONE and all(s is ref for s in sigs.values()):
            return None  # one interned signature on every member: no field can differ
        kind = ref.kind.value

        def describe(field_name: str, value_of: Callable[[Signature], object]) -> str:
            parts = ", ".join(f"rank {self.members[m]} has {value_of(sigs[m])}" for m in members)
            return f"Mismatched {kind} {field_name} for tensor {name!r}: {parts}"

        checks: list[tuple[str, Callable[[Signature], object]]] = [
            ("operations", lambda s: s.kind.value),
            ("data types", lambda s: s.dtype),
            ("reduce ops", lambda s: s.op),
            ("root ranks", lambda s: s.root),
            ("prescale factors", lambda s: s.prescale),
            ("postscale factors", lambda s: s.postscale),
            ("groups", lambda s: s.group or "none"),
            ("paths (HORA_NCCL; whether NCCL loads on each rank)",
             lambda s: "NCCL on the device" if s.device else "host memory"),
            ("join participation", lambda s: "through join" if s.through_join else "joined ranks give zeros"),
        ]
        for label, value_of in checks:
            if any(value_of(sigs[m]) != value_of(ref) for m in members):
                return describe(label, value_of)
        if ref.kind in (Kind.ALLREDUCE, Kind.BROADCAST, Kind.REDUCESCATTER):
            if any(sigs[m].shape != ref.shape for m in members):
                return describe("shapes", lambda s: list(s.shape))
        if ref.kind == Kind.REDUCESCATTER and any(sigs[m].splits != ref.splits for m in members):
            return describe("blocks", lambda s: list(s.splits) if s.splits else "equal blocks")
        if ref.kind in (Kind.ALLGATHER, Kind.ALLTOALL):
            if any(len(sigs[m].shape) == 0 for m in members):
                return f"{kind} of tensor {name!r} needs at least one dimension"
            if any(sigs[m].shape[1:] != ref.shape[1:] for m in members):
                return describe("shapes (all but the first dimension must match)", lambda s: list(s.shape))
        if ref.kind == Kind.ALLTOALL:
            for m in members:
                s = sigs[m]
                if len(s.splits) != self.size or sum(s.splits) != s.shape[0] or min(s.splits, default=0) < 0:
                    return (
                        f"ALLTOALL splits for tensor {name!r} on rank {self.members[m]} are {list(s.splits)}: "
                        f"need {self.size} non-negative entries adding up to the first dimension {s.shape[0]}"
                    )
        if ref.kind == Kind.ADD_PROCESS_SET and any(sigs[m].set_ranks != ref.set_ranks for m in members):
            return describe("rank lists", lambda s: list(s.set_ranks))
        if ref.kind == Kind.REMOVE_PROCESS_SET and any(sigs[m].set_id != ref.set_id for m in members):
            return describe("process set ids", lambda s: s.set_id)
        if ref.kind == Kind.BROADCAST and ref.root not in self.members:
            return f"BROADCAST root rank {ref.root} of tensor {name!r} is not in the process set {self.members}"
        return None

    def stalls(self, now: float, warn_after: float, fail_after: float) -> StallReport:
        """Names waiting too long with some members missing: warnings, and a fatal message past the limit."""
        warnings: list[str] = []
        fatal: str | None = None
        for name, entry in self._pending.items():
            waited = now - entry.first_seen
            missing = [self.members[m] for m in self._needed(entry) if m not in entry.signatures]
            if not missing or all(m in self._joined for m in entry.signatures):
                # Submitted by joined members alone (a sharded optimizer's join probe): they wait for
                # the others' next step, as a joined rank waits for the others to join, for as long
                # as the others train.
                continue
            if fail_after > 0 and waited >= fail_after and fatal is None:
                fatal = (
                    f"stalled for {waited:.0f} s: tensor {name!r} is ready on ranks "
                    f"{[self.members[m] for m in sorted(entry.signatures)]} but ranks {missing} never "
                    "submitted it (HORA_STALL_SHUTDOWN_TIME_SECONDS reached)"
                )
            if warn_after > 0 and waited >= warn_after and now - entry.warned_at >= warn_after:
                entry.warned_at = now
                warnings.append(
                    f"tensor {name!r} has waited {waited:.0f} s: missing ranks {missing} "
                    "(they may have diverged, e.g. skipped a step or submitted another name)"
                )
        return StallReport(warnings, fatal)
