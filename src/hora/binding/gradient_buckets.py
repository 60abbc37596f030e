"""Planning gradient buckets: which gradients travel together as one flat tensor, for every binding.

The engine's cost is per submission, not per byte, so the framework optimizers (hora.torch's hooks,
hora.tensorflow's tape and optimizers, hora.keras on TensorFlow and Keras 2) flatten consecutive
gradients into buckets and reduce each bucket as one request. The rule is the same everywhere and
lives here, free of any framework: buckets hold consecutive gradients in the order backward produces
them (the callers pass reverse variable order), are cut at ``GRADIENT_BUCKET_BYTES`` (never above
the fusion threshold) and wherever the dtype changes, and exist only where the reduction is
element-wise (not Adasum) and the compressor is Horovod's none or fp16 (a custom compressor may not
be element-wise). Flattening and unpacking are each binding's own, with its framework's ops.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from hora.basics import Adasum
from hora.compression import Compression


def bucket_bytes() -> int:
    """The largest bucket, in bytes: ``GRADIENT_BUCKET_BYTES`` capped by the fusion threshold (0: none)."""
    from hora import config

    return max(0, min(int(config.get("gradient_bucket_bytes")), int(config.get("fusion_threshold"))))


def bucketable(op: Any, compression: Any) -> bool:
    """Whether gradients reduced with ``op`` and ``compression`` may share a flat bucket: the result of
    an element-wise reduction does not depend on the layout, Adasum's and a custom compressor's may."""
    return op != Adasum and compression in (Compression.none, Compression.fp16)


def plan(sizes: Sequence[tuple[int, Hashable]], cap: int, singles: bool = False) -> list[list[int]]:
    """Buckets of positions into ``sizes`` (each gradient's (bytes, dtype), in submission order).

    Consecutive positions share a bucket while their total stays within ``cap`` and their dtype is
    the same; only buckets of two or more are returned (a lone gradient travels as itself), unless
    ``singles``: then every position is in a bucket (sharded gradients reduce nothing on its own),
    one per position where ``cap`` is 0.
    """
    if cap <= 0:
        return [[i] for i in range(len(sizes))] if singles else []
    buckets: list[list[int]] = []
    total, dtype = 0, None
    for position, (nbytes, kind) in enumerate(sizes):
        if buckets and total + nbytes <= cap and kind == dtype:
            buckets[-1].append(position)
            total += nbytes
        else:
            buckets.append([position])
            total, dtype = nbytes, kind
    return buckets if singles else [b for b in buckets if len(b) > 1]
