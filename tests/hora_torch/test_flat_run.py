"""hora.torch.flat_run: tensors read and written as one flat vector by element range. No processes.

Packing any range must give exactly the slice of the concatenated tensors, and unpacking it must
write exactly that slice back in place, for ranges that start or end inside a tensor, span several,
or cross empty and non-contiguous ones.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hora.torch.flat_run import FlatRun  # noqa: E402


def tensors():
    t = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    return [torch.arange(5.0), torch.empty(0), torch.arange(100.0, 106.0).reshape(2, 3), t, torch.tensor([7.0])]


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def test_pack_gives_every_range_of_the_concatenation():
    ts = tensors()
    run = FlatRun([t.numel() for t in ts])
    whole = flat(ts)
    assert run.length == whole.numel() == 24
    for start in range(run.length + 1):
        for stop in range(start, run.length + 1):
            out = torch.full((stop - start,), -1.0)
            run.pack(ts, start, stop, out)
            assert torch.equal(out, whole[start:stop]), (start, stop)


def test_pack_reads_a_missing_tensor_as_zeros():
    run = FlatRun([2, 3])
    out = torch.full((4,), -1.0)
    run.pack([torch.tensor([1.0, 2.0]), None], 1, 5, out)
    assert out.tolist() == [2.0, 0.0, 0.0, 0.0]


def test_unpack_writes_exactly_the_range_in_place():
    for start, stop in [(0, 24), (3, 9), (5, 5), (4, 6), (10, 20), (23, 24)]:
        ts = tensors()
        storages = [t.untyped_storage().data_ptr() for t in ts]
        run = FlatRun([t.numel() for t in ts])
        want = flat(ts)
        want[start:stop] = -torch.arange(1.0, stop - start + 1)
        run.unpack(-torch.arange(1.0, stop - start + 1), start, stop, ts)
        assert torch.equal(flat(ts), want), (start, stop)
        assert [t.untyped_storage().data_ptr() for t in ts] == storages  # the same tensors, written in place


def test_a_range_outside_the_run_is_refused():
    run = FlatRun([3])
    with pytest.raises(ValueError, match="not within a run of 3"):
        list(run.pieces(2, 4))
    with pytest.raises(ValueError):
        list(run.pieces(2, 1))
