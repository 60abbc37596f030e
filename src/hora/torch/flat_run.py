"""A run of tensors read and written as one flat vector, by element range, without building it.

A sharded optimizer moves each member's parameters and gradients as one flat run per dtype, in pieces
of bounded size (``hora.binding.shard_plan.chunk_bounds``). Packing a piece copies only the slices of
the tensors that fall inside it, and unpacking writes them back in place, so no flat copy of a whole
run (as large as the shard, or the model) is ever made.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

import torch


class FlatRun:
    """Tensors of the given element counts, laid end to end."""

    def __init__(self, numels: Sequence[int]) -> None:
        self._starts = list(itertools.accumulate((int(n) for n in numels), initial=0))

    @property
    def length(self) -> int:
        return self._starts[-1]

    def pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(item, first, last)``: the element range of each item that ``[start, stop)`` covers, in order."""
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"range [{start}, {stop}) is not within a run of {self.length} elements")
        item = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            first, end = self._starts[item], self._starts[item + 1]
            if end > start:  # items of no elements cover nothing
                last = min(stop, end)
                yield item, start - first, last - first
                start = last
            item += 1

    def pack(self, tensors: Sequence[torch.Tensor | None], start: int, stop: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, stop)`` of the run into ``out`` (of that many elements); a ``None``
        tensor reads as zeros (a gradient a rank never computed). One ``torch.cat`` for the range: a
        model of many small tensors pays Python's cost per call, not per tensor."""
        parts = []
        for item, first, last in self.pieces(start, stop):
            tensor = tensors[item]
            if tensor is None:
                parts.append(torch.zeros(last - first, dtype=out.dtype, device=out.device))
            else:
                parts.append(tensor.reshape(-1)[first:last])
        if len(parts) == 1:
            out.copy_(parts[0])
        elif parts:
            torch.cat(parts, out=out)

    def unpack(self, values: torch.Tensor, start: int, stop: int, tensors: Sequence[torch.Tensor]) -> None:
        """Write ``values`` (elements ``[start, stop)`` of the run) into the tensors, in place, with one
        ``torch._foreach_copy_`` for those that have a flat view."""
        into, pieces = [], []
        offset = 0
        for item, first, last in self.pieces(start, stop):
            piece = values[offset:offset + last - first]
            tensor = tensors[item]
            if tensor.is_contiguous():
                into.append(tensor.view(-1)[first:last])
                pieces.append(piece)
            else:  # no flat view of it exists: write through a copy
                flat = tensor.reshape(-1).clone()
                flat[first:last].copy_(piece)
                tensor.copy_(flat.view(tensor.shape))
            offset += last - first
        if into:
            torch._foreach_copy_(into, pieces)
