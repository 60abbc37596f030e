"""Layout of the device fusion buffer: which tensors travel together, and where each one sits.

Small gradients cost NCCL a launch each; packing them into one device buffer turns many launches
into one, as the host path's fusion does. A bucket holds tensors of one dtype and one reduction
(same op and scales) up to the fusion threshold; each tensor starts at a multiple of
``ALIGNMENT`` bytes, which keeps NCCL's vectorised loads aligned. A tensor at or above the
threshold travels alone, reduced in place without a copy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

#: Byte alignment of each tensor inside the fusion buffer (CUDA's allocation granularity for vectors).
ALIGNMENT = 256


def align(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


@dataclass
class Slot:
    """One tensor's place in a bucket: index in the input list, byte offset, byte length."""

    index: int
    offset: int
    nbytes: int


@dataclass
class FusionBucket:
    key: Hashable
    slots: list[Slot] = field(default_factory=list)
    nbytes: int = 0  # bytes the buffer needs (the last slot's end, aligned)

    @property
    def fused(self) -> bool:
        """Whether the bucket goes through the fusion buffer (more than one tensor)."""
        return len(self.slots) > 1


def plan(entries: Sequence[tuple[Hashable, int]], threshold: int) -> list[FusionBucket]:
    """Buckets for ``entries`` (``(key, nbytes)`` in submission order), keeping that order per key.

    ``key`` is what must match for tensors to share a launch (dtype, op, scales). A threshold of 0
    disables fusion. The order of buckets is the order of each bucket's first tensor, the same on
    every rank because the engine hands every rank the same negotiated list.
    """
    buckets: list[FusionBucket] = []
    open_by_key: dict[Hashable, FusionBucket] = {}
    for index, (key, nbytes) in enumerate(entries):
        if threshold <= 0 or nbytes >= threshold:
            buckets.append(FusionBucket(key, [Slot(index, 0, nbytes)], align(nbytes)))
            continue
        open_bucket = open_by_key.get(key)
        offset = open_bucket.nbytes if open_bucket is not None else 0
        if open_bucket is not None and offset + nbytes <= threshold:
            bucket = open_bucket
        else:
            bucket = FusionBucket(key)
            buckets.append(bucket)
            open_by_key[key] = bucket
            offset = 0
        bucket.slots.append(Slot(index, offset, nbytes))
        bucket.nbytes = align(offset + nbytes)
    return buckets


def buffer_bytes(buckets: Sequence[FusionBucket]) -> int:
    """Size the device fusion buffer must have for these buckets (it is reused bucket after bucket)."""
    return max((b.nbytes for b in buckets if b.fused), default=0)
