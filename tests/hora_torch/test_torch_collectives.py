"""hora.torch collectives on 2 and 3 ranks, checked against values computed here by hand.

Each world size is one ``hora.run`` job (module-scoped fixture) that runs every check as a named
section; the tests below read the sections' results (see tests/sections.py).

Gradient convention: Horovod 0.28.1's (horovod/torch/mpi_ops.py), so a migrated script computes the
same numbers. ``allreduce``'s backward is an allreduce of the upstream gradient with the same op (for
``y = allreduce(x, op=Average)`` and ``loss_r = sum(y)`` each rank's ``x.grad`` is 1). ``allgather``,
``grouped_allgather`` and ``broadcast`` average the upstream gradients across ranks (``allreduce(grad,
op=Average)``), then allgather keeps this rank's rows and broadcast zeroes non-roots. ``reducescatter``
allgathers the upstream gradient and multiplies it by ``size`` for Sum, passing it through for Average
(scale factors apply as in the forward pass).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from sections import JobResults, SharedJob  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the first test runs every module's share of the job

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS = ["Average", "Sum", "Min", "Max", "Product"]
BOOL_OPS = ["Sum", "Min", "Max", "Product"]  # logical or, and, or, and
INTEGER = {torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64}


def dtype_input(dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: small values (no overflow, exact in half precision), odd sums, negatives."""
    if dtype == torch.bool:
        return torch.tensor([True, False, rank % 2 == 0, rank % 2 == 1, True, rank == 0])
    base = [0, 1, 2, 3, 4, 5] if dtype in (torch.uint8, torch.uint16) else [-3, -1, 0, 1, 2, 5]
    return (torch.tensor(base, dtype=torch.int64) + rank).to(dtype).reshape(2, 3)


def expected_reduce(op: str, dtype: torch.dtype, size: int) -> torch.Tensor:
    """What ``allreduce(dtype_input(dtype, r), op=op)`` must give, computed in float64."""
    stack = np.stack([dtype_input(dtype, r).to(torch.float64).numpy() for r in range(size)])
    if dtype == torch.bool:
        value = {"Sum": stack.max(0), "Max": stack.max(0), "Min": stack.min(0), "Product": stack.prod(0)}[op]
        return torch.from_numpy(value).to(torch.bool)
    value = {"Sum": stack.sum(0), "Min": stack.min(0), "Max": stack.max(0), "Product": stack.prod(0),
             "Average": stack.sum(0) / size}[op]
    if op == "Average" and dtype in INTEGER:
        value = np.trunc(value)  # integer Average truncates (towards zero, as C integer division)
    return torch.from_numpy(value).to(dtype)


class Uint16Result:
    """A uint16 tensor on its way back from a worker: torch cannot pickle that dtype's storage."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.array = tensor.numpy()


def portable(tensor: torch.Tensor):
    return Uint16Result(tensor) if tensor.dtype == torch.uint16 else tensor


def unpacked(value):
    return torch.from_numpy(value.array) if isinstance(value, Uint16Result) else value


# ---- the jobs ---------------------------------------------------------------------------------


def _common_sections(hvd, r: int, n: int) -> list:
    """Sections that run on any world size."""
    sections = []

    def reduce_case(dtype, op):
        return lambda: portable(hvd.allreduce(dtype_input(dtype, r), op=getattr(hvd, op)))

    for dtype in DTYPES:
        for op in OPS:
            sections.append((f"dtype.{dtype}.{op}", reduce_case(dtype, op)))
    for op in BOOL_OPS:
        sections.append((f"dtype.{torch.bool}.{op}", reduce_case(torch.bool, op)))

    def allgather_uneven():
        outs = {}
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
            t = torch.full((r + 1, 3), r, dtype=torch.int64).to(dtype)
            outs[str(dtype)] = hvd.allgather(t)
        return outs

    def broadcast_each_root():
        outs = []
        for root in range(n):
            t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r
            original = t.clone()
            outs.append({"out": hvd.broadcast(t, root), "input_unchanged": torch.equal(t, original)})
        return outs

    def broadcast_inplace_each_root():
        outs = []
        for root in range(n):
            t = torch.arange(4, dtype=torch.int32) + 10 * r
            ptr = t.data_ptr()
            res = hvd.broadcast_(t, root)
            u = torch.full((3,), float(r))
            h = hvd.broadcast_async_(u, root)
            res_async = hvd.synchronize(h)
            outs.append({"t": t.clone(), "same_object": res is t, "same_ptr": t.data_ptr() == ptr,
                         "async": u.clone(), "async_same_object": res_async is u})
        return outs

    def reducescatter_uneven():
        rows = 2 * n + 1  # not divisible by n: earlier ranks get one more row
        t = (torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 1) * (r + 1)
        return {"sum": hvd.reducescatter(t, op=hvd.Sum), "average": hvd.reducescatter(t),
                "rows": rows}

    def alltoall_splits():
        # rank r sends j + 1 rows to rank j (rows valued 100 r + j)
        splits = [j + 1 for j in range(n)]
        rows = torch.cat([torch.full((j + 1, 2), 100.0 * r + j) for j in range(n)])
        out, received = hvd.alltoall(rows, splits=splits)
        return {"out": out, "received": received}

    sections += [
        ("allgather.uneven", allgather_uneven),
        ("broadcast.each_root", broadcast_each_root),
        ("broadcast_.each_root", broadcast_inplace_each_root),
        ("reducescatter.uneven", reducescatter_uneven),
        ("alltoall.splits", alltoall_splits),
    ]
    return sections


def _job_2ranks() -> list:
    import warnings

    import hora.torch as hvd

    r, n = hvd.rank(), hvd.size()
    sections = _common_sections(hvd, r, n)

    def bool_average():
        try:
            hvd.allreduce(dtype_input(torch.bool, r))
        except TypeError as exc:
            return f"TypeError: {exc}"
        return "no error"

    def inplace():
        t = torch.full((2, 3), float(r + 1))
        ptr = t.data_ptr()
        res = hvd.allreduce_(t, op=hvd.Sum)
        u = torch.full((4,), float(r + 1), dtype=torch.float64)
        uptr = u.data_ptr()
        h = hvd.allreduce_async_(u, op=hvd.Average, name="inplace.async")
        res_u = hvd.synchronize(h)
        b = torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16) * (r + 1)
        bptr = b.data_ptr()
        res_b = hvd.allreduce_(b, op=hvd.Sum)
        return {"bf16": b.clone(), "bf16_same": res_b is b and b.data_ptr() == bptr,
                "t": t.clone(), "res_is_t": res is t, "t_ptr": t.data_ptr() == ptr,
                "u": u.clone(), "res_is_u": res_u is u, "u_ptr": u.data_ptr() == uptr,
                "poll_after": hvd.poll(h)}

    def not_inplace():
        t = torch.full((3,), float(r + 1))
        h = hvd.allreduce_async(t, op=hvd.Sum)
        out = hvd.synchronize(h)
        return {"out": out, "input": t.clone(), "poll": hvd.poll(h), "shares": out.data_ptr() == t.data_ptr()}

    def non_contiguous():
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * r
        view = base.t()  # (4, 3), not contiguous
        out = hvd.allreduce(view, op=hvd.Sum)
        base2 = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * r
        view2 = base2.t()
        ptr = view2.data_ptr()
        res = hvd.allreduce_(view2, op=hvd.Sum)
        sliced = (torch.arange(10, dtype=torch.float64) + r)[::2]  # strided 1-D
        return {"out": out, "inplace": view2.clone(), "inplace_ptr": view2.data_ptr() == ptr,
                "res_is_view": res is view2, "base2": base2.clone(), "strided": hvd.allreduce(sliced)}

    def scaling():
        x = torch.full((3,), float(r + 1))
        return {
            "avg": hvd.allreduce(x, op=hvd.Average, prescale_factor=3.0, postscale_factor=2.0),
            "sum": hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0),
            "inplace": hvd.allreduce_(x.clone(), op=hvd.Sum, postscale_factor=0.25),
        }

    def deprecated_average():
        x = torch.full((2,), float(r + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {"true": hvd.allreduce(x, average=True), "false": hvd.allreduce(x, average=False),
                    "default": hvd.allreduce(x)}

    def average_and_op():
        errors = {}
        x = torch.ones(2)
        for label, call in (
            ("allreduce", lambda: hvd.allreduce(x, average=True, op=hvd.Sum)),
            ("allreduce_async", lambda: hvd.allreduce_async(x, average=False, op=hvd.Average)),
            ("allreduce_", lambda: hvd.allreduce_(x.clone(), average=True, op=hvd.Average)),
            ("allreduce_async_", lambda: hvd.allreduce_async_(x.clone(), average=True, op=hvd.Sum)),
            ("grouped_allreduce", lambda: hvd.grouped_allreduce([x], average=True, op=hvd.Sum)),
        ):
            try:
                call()
                errors[label] = None
            except ValueError as exc:
                errors[label] = f"ValueError: {exc}"
        # Every rank raised at submission: nothing is in flight, and the next collective works.
        errors["after"] = hvd.allreduce(torch.full((1,), float(r)), op=hvd.Sum)
        return errors

    def zero_dim():
        return {"allreduce": hvd.allreduce(torch.tensor(float(r + 1))),
                "broadcast": hvd.broadcast(torch.tensor(r + 5), 1),
                "broadcast_": hvd.broadcast_(torch.tensor(float(r + 5)), 1)}

    def grouped():
        a = [torch.full((2,), float(r + 1)), torch.full((3, 2), 2.0 * (r + 1), dtype=torch.float64),
             torch.full((1,), r + 1, dtype=torch.int32)]
        plain = hvd.grouped_allreduce(a, op=hvd.Sum)
        originals = [t.clone() for t in a]
        h = hvd.grouped_allreduce_async(a)
        async_out = hvd.synchronize(h)
        b = [t.clone() for t in a]
        ptrs = [t.data_ptr() for t in b]
        inplace = hvd.grouped_allreduce_(b, op=hvd.Sum)
        c = [t.clone() for t in a]
        h2 = hvd.grouped_allreduce_async_(c, op=hvd.Max)
        inplace_async = hvd.synchronize(h2)
        return {
            "plain": plain, "inputs_unchanged": all(torch.equal(x, y) for x, y in zip(a, originals)),
            "async": async_out, "poll": hvd.poll(h),
            "inplace": [t.clone() for t in b], "inplace_objects": all(x is y for x, y in zip(inplace, b)),
            "inplace_ptrs": [t.data_ptr() for t in b] == ptrs,
            "inplace_async": [t.clone() for t in c],
            "inplace_async_objects": all(x is y for x, y in zip(inplace_async, c)),
            "compressed": hvd.grouped_allreduce([a[0], a[1]], compression=hvd.Compression.fp16),
        }

    def allgather_variants():
        t = torch.full((r + 1, 2), float(r))
        h = hvd.allgather_async(t)
        g = hvd.grouped_allgather([t, torch.full((2 - r,), r, dtype=torch.int16)])
        h2 = hvd.grouped_allgather_async([torch.full((1, 1), float(r))])
        return {"async": hvd.synchronize(h), "grouped": g, "grouped_async": hvd.synchronize(h2)}

    def broadcast_async_plain():
        t = torch.full((2,), float(r))
        h = hvd.broadcast_async(t, 1)
        return {"out": hvd.synchronize(h), "input": t.clone()}

    def alltoall_variants():
        t = torch.arange(4, dtype=torch.float32) + 10 * r
        plain = hvd.alltoall(t)
        splits = [1, 2] if r == 0 else [2, 1]
        u = torch.arange(3, dtype=torch.int64).repeat_interleave(2).reshape(3, 2) + 10 * r
        out_list, recv_list = hvd.alltoall(u, splits=splits)
        out_tensor, recv_tensor = hvd.alltoall(u, splits=torch.tensor(splits, dtype=torch.int32))
        h = hvd.alltoall_async(u, splits=splits)
        async_out = hvd.synchronize(h)
        return {"plain": plain, "plain_is_tensor": isinstance(plain, torch.Tensor),
                "out": out_list, "received": recv_list, "out_t": out_tensor, "received_t": recv_tensor,
                "async": async_out}

    def reducescatter_variants():
        t = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (r + 1)
        h = hvd.reducescatter_async(t, op=hvd.Sum)
        grouped = hvd.grouped_reducescatter([t, torch.ones(3, dtype=torch.float64) * (r + 1)], op=hvd.Sum)
        grouped_avg = hvd.grouped_reducescatter([t])
        h2 = hvd.grouped_reducescatter_async([t, t * 2], op=hvd.Sum)
        scaled = hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
        fp16 = hvd.reducescatter(t / 3, compression=hvd.Compression.fp16)
        try:
            hvd.reducescatter(t, op=hvd.Min)
            bad_op = None
        except ValueError as exc:
            bad_op = str(exc)
        return {"async": hvd.synchronize(h), "grouped": grouped, "grouped_avg": grouped_avg,
                "grouped_async": hvd.synchronize(h2), "scaled": scaled, "fp16": fp16, "bad_op": bad_op}

    def sparse():
        # rank 0 has rows {0, 2}, rank 1 rows {1, 2}: row 2 overlaps.
        idx = torch.tensor([[r, 2]])
        vals = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * (r + 1)
        t = torch.sparse_coo_tensor(idx, vals, (4, 2), check_invariants=False)
        s = hvd.synchronize(hvd.sparse_allreduce_async(t, "sparse.sum", hvd.Sum))
        a = hvd.synchronize(hvd.sparse_allreduce_async(t, "sparse.avg", hvd.Average))
        return {"sum": s.to_dense(), "avg": a.to_dense(), "sum_is_sparse": s.is_sparse, "dense_in": t.to_dense()}

    def fp16_compression():
        x = torch.tensor([1.0001, 2.5, -3.14159, 1e-3]) * (r + 1)
        y = hvd.allreduce(x, compression=hvd.Compression.fp16)
        ints = hvd.allreduce(torch.tensor([r + 1, 3]), op=hvd.Sum, compression=hvd.Compression.fp16)
        c, ctx = hvd.Compression.fp16.compress(x)
        back = hvd.Compression.fp16.decompress(c, ctx)
        nc, nctx = hvd.Compression.none.compress(x)
        return {"y": y, "ints": ints, "compressed_dtype": c.dtype, "back": back,
                "none_same": nc is x and hvd.Compression.none.decompress(nc, nctx) is x}

    def bf16_compression():
        # 70000 overflows float16 (inf) and 1e-8 underflows it (0); bfloat16 keeps both magnitudes.
        x = torch.tensor([1.0001, 70000.0, 1e-8, -3.14159]) * (r + 1)
        y = hvd.allreduce(x, compression=hvd.Compression.bf16)
        ints = hvd.allreduce(torch.tensor([r + 1, 3]), op=hvd.Sum, compression=hvd.Compression.bf16)
        c, ctx = hvd.Compression.bf16.compress(x)
        half, half_ctx = hvd.Compression.bf16.compress(x.half())
        return {"y": y, "ints": ints, "compressed_dtype": c.dtype, "back": hvd.Compression.bf16.decompress(c, ctx),
                "half_unchanged": half.dtype == torch.float16 and half_ctx is None}

    def mismatch():
        # Shapes that disagree across ranks: RuntimeError on every rank, and the job goes on.
        try:
            hvd.allreduce(torch.ones(2 + r), name="mismatch.shape")
            error = None
        except RuntimeError as exc:
            error = type(exc).__name__
        return {"error": error, "after": hvd.allreduce(torch.ones(2), op=hvd.Sum, name="mismatch.after")}

    def control():
        hvd.barrier()
        h = hvd.allreduce_async(torch.ones(1), name="control.poll")
        value = hvd.synchronize(h)
        return {"barrier": hvd.barrier(), "value": value, "poll": hvd.poll(h)}

    # ---- autograd: loss_r depends on the rank so that the averaging/summing is visible ----------

    def grad_allreduce():
        x = torch.ones(3, requires_grad=True)
        y = hvd.allreduce(x * (r + 1))  # Average
        (y * (r + 1)).sum().backward()
        xs = torch.ones(3, requires_grad=True)
        ys = hvd.allreduce(xs, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)
        (ys * (r + 1)).sum().backward()
        xf = torch.ones(3, requires_grad=True)
        hvd.allreduce(xf, compression=hvd.Compression.fp16).sum().backward()
        a = torch.ones(2, requires_grad=True)
        b = torch.ones(3, requires_grad=True)
        ga, gb = hvd.grouped_allreduce([a, b * 2], op=hvd.Sum)
        (ga.sum() * (r + 1) + gb.sum()).backward()
        return {"average": x.grad, "sum_scaled": xs.grad, "fp16": xf.grad, "grouped_a": a.grad, "grouped_b": b.grad}

    def grad_allgather():
        x = torch.ones(r + 1, 2, requires_grad=True)
        y = hvd.allgather(x)
        w = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) * (r + 1)
        (y * w).sum().backward()
        return x.grad

    def grad_broadcast():
        x = torch.ones(3, requires_grad=True)
        (hvd.broadcast(x, 1) * (r + 1)).sum().backward()
        return x.grad

    def grad_alltoall():
        x = torch.ones(4, requires_grad=True)
        (hvd.alltoall(x) * torch.arange(4.0) * (r + 1)).sum().backward()
        xs = torch.ones(3, requires_grad=True)
        y, _ = hvd.alltoall(xs, splits=[1, 2] if r == 0 else [2, 1])
        (y * torch.arange(3.0) * (r + 1)).sum().backward()
        return {"even": x.grad, "splits": xs.grad}

    def grad_reducescatter():
        x = torch.ones(5, requires_grad=True)
        (hvd.reducescatter(x, op=hvd.Sum) * (r + 1)).sum().backward()
        xa = torch.ones(5, requires_grad=True)
        (hvd.reducescatter(xa, prescale_factor=3.0) * (r + 1)).sum().backward()
        return {"sum": x.grad, "average_prescaled": xa.grad}

    def grad_grouped_allgather():
        a = torch.ones(r + 1, 2, requires_grad=True)
        b = torch.ones(2 - r, requires_grad=True)
        ga, gb = hvd.grouped_allgather([a, b])
        ((ga * torch.arange(6.0).reshape(3, 2)).sum() * (r + 1) + (gb * torch.arange(3.0)).sum()).backward()
        return {"a": a.grad, "b": b.grad, "requires_grad": ga.requires_grad and gb.requires_grad}

    def grad_grouped_reducescatter():
        a = torch.ones(5, requires_grad=True)
        b = torch.ones(2, 3, requires_grad=True)
        ra, rb = hvd.grouped_reducescatter([a, b], op=hvd.Sum, postscale_factor=2.0)
        ((ra * (r + 1)).sum() + (rb * (r + 1)).sum()).backward()
        c = torch.ones(4, requires_grad=True)
        (rc,) = hvd.grouped_reducescatter([c])
        (rc * (r + 1)).sum().backward()
        return {"a": a.grad, "b": b.grad, "c": c.grad}

    def grad_modes():
        # Autograd records a collective only when it must: an input that requires grad, with grad
        # enabled. Otherwise the call skips the autograd Function; the values are the same.
        x = torch.full((4,), float(r + 1), requires_grad=True)
        plain = torch.full((4,), float(r + 1))
        calls = {
            "allreduce": lambda t: hvd.allreduce(t, op=hvd.Sum),
            "grouped_allreduce": lambda t: hvd.grouped_allreduce([t, t * 2], op=hvd.Sum)[1],
            "allgather": lambda t: hvd.allgather(t),
            "grouped_allgather": lambda t: hvd.grouped_allgather([t])[0],
            "broadcast": lambda t: hvd.broadcast(t, 1),
            "alltoall": lambda t: hvd.alltoall(t, splits=[2, 2])[0],
            "reducescatter": lambda t: hvd.reducescatter(t, op=hvd.Sum),
            "grouped_reducescatter": lambda t: hvd.grouped_reducescatter([t], op=hvd.Sum)[0],
        }
        out = {}
        for label, call in calls.items():
            recorded = call(x)
            with torch.no_grad():
                unrecorded = call(x)
            direct = call(plain)
            out[label] = {"recorded": recorded.grad_fn is not None,
                          "no_grad": unrecorded.grad_fn is None and not unrecorded.requires_grad,
                          "plain": direct.grad_fn is None and not direct.requires_grad,
                          "same": torch.equal(recorded.detach(), unrecorded) and torch.equal(unrecorded, direct)}
        return out

    def join():
        # Rank 0 joins at once; rank 1 reduces alone (rank 0 counts as zeros), then joins last.
        if r == 0:
            return {"join": hvd.join()}
        avg = hvd.allreduce(torch.full((2,), 4.0), name="join.average")
        total = hvd.allreduce(torch.full((2,), 4.0), op=hvd.Sum, name="join.sum")
        return {"join": hvd.join(), "average": avg, "sum": total}

    def after_join():
        return hvd.allreduce(torch.full((1,), float(r + 1)), op=hvd.Sum, name="after_join")

    def allgather_while_joined():
        # Rank 0 joins; rank 1's allgather fails at once (only allreduce works with join), then it joins.
        if r == 0:
            return {"join": hvd.join()}
        try:
            hvd.allgather(torch.ones(2))
            error = None
        except RuntimeError as exc:
            error = str(exc)
        return {"error": error, "join": hvd.join()}

    def objects_after_join():
        # Unnamed collectives pair up again across ranks once everyone has joined.
        return {"objects": hvd.allgather_object(r), "gathered": hvd.allgather(torch.tensor([r]))}

    def scaled_half():
        # Horovod scales float16 through float32: factor rounded to float32, product rounded back.
        factor = 0.1915194503788923
        torch.manual_seed(1234)
        t = torch.FloatTensor(8, 8).random_(-100, 100).half() + r
        group = [t + k for k in range(5)]
        return {"rs_pre": hvd.reducescatter(t, op=hvd.Sum, prescale_factor=factor),
                "rs_post": hvd.reducescatter(t, op=hvd.Sum, postscale_factor=factor),
                "grs_pre": hvd.grouped_reducescatter(group, op=hvd.Sum, prescale_factor=factor),
                "ar_pre": hvd.allreduce(t, op=hvd.Sum, prescale_factor=factor),
                "ar_post": hvd.allreduce(t, op=hvd.Average, postscale_factor=factor)}

    sections += [
        ("bool.average", bool_average),
        ("inplace", inplace),
        ("not_inplace", not_inplace),
        ("non_contiguous", non_contiguous),
        ("scaling", scaling),
        ("deprecated_average", deprecated_average),
        ("average_and_op", average_and_op),
        ("zero_dim", zero_dim),
        ("grouped", grouped),
        ("allgather.variants", allgather_variants),
        ("broadcast.async", broadcast_async_plain),
        ("alltoall.variants", alltoall_variants),
        ("reducescatter.variants", reducescatter_variants),
        ("sparse", sparse),
        ("fp16", fp16_compression),
        ("bf16", bf16_compression),
        ("mismatch", mismatch),
        ("control", control),
        ("grad.allreduce", grad_allreduce),
        ("grad.allgather", grad_allgather),
        ("grad.broadcast", grad_broadcast),
        ("grad.alltoall", grad_alltoall),
        ("grad.reducescatter", grad_reducescatter),
        ("grad.grouped_allgather", grad_grouped_allgather),
        ("grad.grouped_reducescatter", grad_grouped_reducescatter),
        ("grad.modes", grad_modes),
        # last: rank 0 skips the named collectives inside (see _job_3ranks)
        ("scaled.half", scaled_half),
        ("join", join),
        ("after_join", after_join),
        ("allgather_while_joined", allgather_while_joined),
        ("objects_after_join", objects_after_join),
    ]
    return sections


def _job_3ranks() -> list:
    import hora.torch as hvd

    r, n = hvd.rank(), hvd.size()
    sections = [(name, f) for name, f in _common_sections(hvd, r, n) if not name.endswith(".Product")]

    def grad_allgather():
        x = torch.ones(r + 1, 2, requires_grad=True)
        y = hvd.allgather(x)
        w = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) * (r + 1)
        (y * w).sum().backward()
        return x.grad

    def grad_reducescatter():
        x = torch.ones(7, requires_grad=True)
        (hvd.reducescatter(x) * (r + 1)).sum().backward()
        return x.grad

    def process_set():
        # every rank registers every set, in the same order
        ps = hvd.add_process_set([0, 2])
        solo = hvd.add_process_set(hvd.ProcessSet([1]))
        out = {"included": ps.included(), "size": ps.size()}
        if ps.included():
            out["rank_in_set"] = ps.rank()
            out["allreduce"] = hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, process_set=ps)
            out["average"] = hvd.allreduce(torch.full((2,), float(r + 1)), process_set=ps)
            out["allgather"] = hvd.allgather(torch.full((1,), float(r)), process_set=ps)
            out["broadcast"] = hvd.broadcast(torch.full((2,), float(r)), root_rank=2, process_set=ps)
            out["alltoall"] = hvd.alltoall(torch.tensor([10.0 * r, 10.0 * r + 1]), process_set=ps)
            out["reducescatter"] = hvd.reducescatter(torch.arange(4.0) * (r + 1), op=hvd.Sum, process_set=ps)
            x = torch.ones(2, requires_grad=True)
            hvd.allgather(x, process_set=ps).sum().backward()
            out["allgather_grad"] = x.grad
            hvd.barrier(process_set=ps)
        else:
            # Meanwhile the excluded rank can use the global set.
            out["alone"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=solo)
        removed = [hvd.remove_process_set(ps), hvd.remove_process_set(solo)]  # collective: both, always
        out["removed"] = all(removed)
        return out

    def join():
        # Ranks 0, 1 join; rank 2 reduces once more (joined ranks add zeros), then joins last.
        if r == 2:
            avg = hvd.allreduce(torch.full((2,), 6.0), name="join.average")
            return {"join": hvd.join(), "average": avg}
        return {"join": hvd.join()}

    # Sections whose calls differ between ranks come last: unnamed collectives take their names
    # from a per-process counter, which they leave out of step across ranks (as in Horovod).
    sections += [
        ("grad.allgather", grad_allgather),
        ("grad.reducescatter", grad_reducescatter),
        ("process_set", process_set),
        ("join", join),
    ]
    return sections


# One job per world size for every hora.torch module (each worker imports torch once): tests/sections.py.
RANKS2, RANKS3 = SharedJob(_job_2ranks, np=2), SharedJob(_job_3ranks, np=3)


@pytest.fixture(scope="module")
def ranks2(request) -> JobResults:
    return RANKS2.results(request)


@pytest.fixture(scope="module")
def ranks3(request) -> JobResults:
    return RANKS3.results(request)


@pytest.fixture(params=["ranks2", "ranks3"], ids=["2ranks", "3ranks"])
def job(request) -> JobResults:
    """The 2-rank and the 3-rank job, for checks that hold on any world size."""
    return request.getfixturevalue(request.param)


# ---- dtypes x ops -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_dtype_op_2ranks(ranks2, dtype, op):
    want = expected_reduce(op, dtype, 2)
    for r in range(2):
        got = unpacked(ranks2.get(f"dtype.{dtype}.{op}", r))
        assert got.dtype == dtype and got.shape == (2, 3)
        assert torch.equal(got, want), (r, got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["Average", "Sum", "Min", "Max"])
def test_allreduce_dtype_op_3ranks(ranks3, dtype, op):
    want = expected_reduce(op, dtype, 3)
    for r in range(3):
        got = unpacked(ranks3.get(f"dtype.{dtype}.{op}", r))
        assert got.dtype == dtype and torch.equal(got, want), (r, got, want)


def test_integer_average_truncates_towards_zero_2ranks(ranks2):
    # rank inputs -3 and -2 average to -2.5 -> -2; 5 and 6 -> 5.5 -> 5 (see dtype_input)
    got = ranks2.get(f"dtype.{torch.int32}.Average", 0)
    assert got.tolist() == [[-2, 0, 0], [1, 2, 5]]


@pytest.mark.parametrize("op", BOOL_OPS)
def test_allreduce_bool_2ranks(ranks2, op):
    want = expected_reduce(op, torch.bool, 2)
    for r in range(2):
        got = ranks2.get(f"dtype.{torch.bool}.{op}", r)
        assert got.dtype == torch.bool and torch.equal(got, want)


def test_allreduce_bool_average_is_a_type_error_2ranks(ranks2):
    for r in range(2):
        assert ranks2.get("bool.average", r).startswith("TypeError")


# ---- allreduce forms --------------------------------------------------------------------------


def test_allreduce_inplace_keeps_the_tensor_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("inplace", r)
        assert torch.equal(got["t"], torch.full((2, 3), 3.0))
        assert got["res_is_t"] and got["t_ptr"]
        assert torch.equal(got["u"], torch.full((4,), 1.5, dtype=torch.float64))
        assert got["res_is_u"] and got["u_ptr"] and got["poll_after"]
        assert got["bf16"].dtype == torch.bfloat16 and got["bf16"].tolist() == [4.5, -6.0, 9.0] and got["bf16_same"]


def test_allreduce_async_returns_a_new_tensor_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("not_inplace", r)
        assert torch.equal(got["out"], torch.full((3,), 3.0))
        assert torch.equal(got["input"], torch.full((3,), float(r + 1)))
        assert got["poll"] and not got["shares"]


def test_allreduce_non_contiguous_2ranks(ranks2):
    base_sum = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2 + 100)
    for r in range(2):
        got = ranks2.get("non_contiguous", r)
        assert torch.equal(got["out"], base_sum.t())
        assert torch.equal(got["inplace"], base_sum.t()) and got["inplace_ptr"] and got["res_is_view"]
        assert torch.equal(got["base2"], base_sum)  # the view's storage was written
        assert torch.equal(got["strided"], torch.arange(0, 10, 2, dtype=torch.float64) + 0.5)


def test_allreduce_prescale_postscale_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("scaling", r)
        assert torch.allclose(got["avg"], torch.full((3,), 2.0 * 3.0 * (1 + 2) / 2))
        assert torch.allclose(got["sum"], torch.full((3,), 4.0 * 0.5 * (1 + 2)))
        assert torch.allclose(got["inplace"], torch.full((3,), 0.25 * 3))


def test_allreduce_deprecated_average_argument_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("deprecated_average", r)
        assert torch.equal(got["true"], torch.full((2,), 1.5))
        assert torch.equal(got["false"], torch.full((2,), 3.0))
        assert torch.equal(got["default"], torch.full((2,), 1.5))


def test_average_and_op_together_raise_value_error_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("average_and_op", r)
        for label in ("allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce"):
            assert got[label] is not None and got[label].startswith("ValueError"), label
        assert torch.equal(got["after"], torch.tensor([1.0]))


def test_zero_dim_tensors_keep_their_shape_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("zero_dim", r)
        assert got["allreduce"].shape == () and got["allreduce"].item() == 1.5
        assert got["broadcast"].shape == () and got["broadcast"].item() == 6
        assert got["broadcast_"].shape == () and got["broadcast_"].item() == 6.0


def test_grouped_allreduce_forms_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("grouped", r)
        assert [t.tolist() for t in got["plain"]] == [[3.0, 3.0], [[6.0, 6.0]] * 3, [3]]
        assert [t.dtype for t in got["plain"]] == [torch.float32, torch.float64, torch.int32]
        assert got["inputs_unchanged"]
        assert [t.tolist() for t in got["async"]] == [[1.5, 1.5], [[3.0, 3.0]] * 3, [1]]  # int average truncates
        assert got["poll"]
        assert [t.tolist() for t in got["inplace"]] == [[3.0, 3.0], [[6.0, 6.0]] * 3, [3]]
        assert got["inplace_objects"] and got["inplace_ptrs"]
        assert [t.tolist() for t in got["inplace_async"]] == [[2.0, 2.0], [[4.0, 4.0]] * 3, [2]]
        assert got["inplace_async_objects"]
        compressed = got["compressed"]
        assert [t.dtype for t in compressed] == [torch.float32, torch.float64]
        assert compressed[0].tolist() == [1.5, 1.5] and compressed[1].tolist() == [[3.0, 3.0]] * 3


# ---- allgather, broadcast, alltoall, reducescatter ---------------------------------------------


def test_allgather_different_first_dims(job):
    n = job.size
    for dtype_name, _ in job.get("allgather.uneven", 0).items():
        want = torch.cat([torch.full((k + 1, 3), k, dtype=torch.int64) for k in range(n)])
        for r in range(n):
            got = job.get("allgather.uneven", r)[dtype_name]
            assert str(got.dtype) == dtype_name
            assert torch.equal(got.to(torch.int64), want.to(got.dtype).to(torch.int64)), (r, dtype_name)


def test_allgather_async_and_grouped_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("allgather.variants", r)
        assert got["async"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert got["grouped"][0].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert got["grouped"][1].tolist() == [0, 0, 1] and got["grouped"][1].dtype == torch.int16
        assert [t.tolist() for t in got["grouped_async"]] == [[[0.0], [1.0]]]


def test_broadcast_from_each_root(job):
    n = job.size
    for r in range(n):
        for root, got in enumerate(job.get("broadcast.each_root", r)):
            assert torch.equal(got["out"], torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * root)
            assert got["input_unchanged"]


def test_broadcast_inplace_from_each_root(job):
    n = job.size
    for r in range(n):
        for root, got in enumerate(job.get("broadcast_.each_root", r)):
            assert torch.equal(got["t"], torch.arange(4, dtype=torch.int32) + 10 * root)
            assert got["same_object"] and got["same_ptr"]
            assert torch.equal(got["async"], torch.full((3,), float(root))) and got["async_same_object"]


def test_broadcast_async_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("broadcast.async", r)
        assert got["out"].tolist() == [1.0, 1.0] and got["input"].tolist() == [float(r)] * 2


def test_alltoall_with_splits(job):
    n = job.size
    for r in range(n):
        got = job.get("alltoall.splits", r)
        # rank r receives r + 1 rows from every rank k, valued 100 k + r
        want = torch.cat([torch.full((r + 1, 2), 100.0 * k + r) for k in range(n)])
        assert torch.equal(got["out"], want)
        assert got["received"].tolist() == [r + 1] * n


def test_alltoall_variants_2ranks(ranks2):
    base = torch.arange(3).repeat_interleave(2).reshape(3, 2)
    rows = {0: base, 1: base + 10}
    want_out = {0: torch.cat([rows[0][:1], rows[1][:2]]), 1: torch.cat([rows[0][1:], rows[1][2:]])}
    want_recv = {0: [1, 2], 1: [2, 1]}
    for r in range(2):
        got = ranks2.get("alltoall.variants", r)
        assert got["plain_is_tensor"]
        assert got["plain"].tolist() == ([0.0, 1.0, 10.0, 11.0] if r == 0 else [2.0, 3.0, 12.0, 13.0])
        for out_key, recv_key in (("out", "received"), ("out_t", "received_t")):
            assert torch.equal(got[out_key], want_out[r])
            assert isinstance(got[recv_key], torch.Tensor) and got[recv_key].tolist() == want_recv[r]
        out, received = got["async"]  # synchronize on an alltoall handle gives (output, received_splits)
        assert torch.equal(out, want_out[r]) and received.tolist() == want_recv[r]


def test_reducescatter_first_dim_not_divisible(job):
    n = job.size
    rows = 2 * n + 1
    base = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 1
    total = base * sum(k + 1 for k in range(n))
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    starts = [sum(counts[:k]) for k in range(n)]
    for r in range(n):
        got = job.get("reducescatter.uneven", r)
        mine = total[starts[r] : starts[r] + counts[r]]
        assert torch.equal(got["sum"], mine), (r, got["sum"], mine)
        assert torch.allclose(got["average"], mine / n)


def test_reducescatter_variants_2ranks(ranks2):
    t = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    total = t * 3
    for r in range(2):
        got = ranks2.get("reducescatter.variants", r)
        mine = total[2 * r : 2 * r + 2]
        assert torch.equal(got["async"], mine)
        assert torch.equal(got["grouped"][0], mine)
        assert torch.equal(got["grouped"][1], torch.full((2 - r,), 3.0, dtype=torch.float64))
        assert torch.allclose(got["grouped_avg"][0], mine / 2)
        assert torch.equal(got["grouped_async"][0], mine) and torch.equal(got["grouped_async"][1], 2 * mine)
        assert torch.allclose(got["scaled"], mine)
        assert got["fp16"].dtype == torch.float32
        assert torch.allclose(got["fp16"], mine / 6, rtol=1e-3, atol=1e-3)
        assert got["bad_op"] is not None


def test_sparse_allreduce_async_2ranks(ranks2):
    dense = [ranks2.get("sparse", r)["dense_in"] for r in range(2)]
    for r in range(2):
        got = ranks2.get("sparse", r)
        assert got["sum_is_sparse"]
        assert torch.allclose(got["sum"], dense[0] + dense[1])
        assert torch.allclose(got["avg"], (dense[0] + dense[1]) / 2)


def test_bf16_compression_keeps_what_fp16_loses_2ranks(ranks2):
    """Compression.bf16 (hora's addition): float32 travels as bfloat16 and comes back float32."""
    x = torch.tensor([1.0001, 70000.0, 1e-8, -3.14159])
    for r in range(2):
        got = ranks2.get("bf16", r)
        mine = x * (r + 1)
        assert got["compressed_dtype"] == torch.bfloat16
        assert got["back"].dtype == torch.float32 and torch.equal(got["back"], mine.to(torch.bfloat16).float())
        assert got["y"].dtype == torch.float32 and torch.isfinite(got["y"]).all()
        assert torch.allclose(got["y"], x * 1.5, rtol=2 ** -7)  # bfloat16: 8 significant bits
        assert got["y"][2] > 0  # fp16 would have sent 0
        assert got["ints"].dtype == torch.int64 and got["ints"].tolist() == [3, 6]
        assert got["half_unchanged"]


def test_fp16_compression_2ranks(ranks2):
    x = torch.tensor([1.0001, 2.5, -3.14159, 1e-3])
    for r in range(2):
        got = ranks2.get("fp16", r)
        assert got["y"].dtype == torch.float32
        assert torch.allclose(got["y"], x * 1.5, rtol=1e-3, atol=1e-4)  # fp16: 11 significant bits
        assert got["ints"].dtype == torch.int64 and got["ints"].tolist() == [3, 6]  # ints pass uncompressed
        assert got["compressed_dtype"] == torch.float16
        assert got["back"].dtype == torch.float32
        assert got["none_same"]


def test_mismatched_shapes_raise_runtime_error_on_every_rank_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("mismatch", r)
        assert got["error"] is not None, "a shape mismatch must raise"
        assert got["after"].tolist() == [2.0, 2.0]


def test_barrier_poll_synchronize_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("control", r)
        assert got["barrier"] is None and got["poll"] and got["value"].tolist() == [1.0]


def test_join_2ranks(ranks2):
    for r in range(2):
        assert ranks2.get("join", r)["join"] == 1  # rank 1 joined last
    got = ranks2.get("join", 1)
    assert got["average"].tolist() == [2.0, 2.0]  # (0 + 4) / 2: Average divides by the full size
    assert got["sum"].tolist() == [4.0, 4.0]
    for r in range(2):
        assert ranks2.get("after_join", r).tolist() == [3.0]  # collectives work again after join


def test_allgather_while_a_rank_has_joined_raises_and_the_job_goes_on_2ranks(ranks2):
    error = ranks2.get("allgather_while_joined", 1)["error"]
    assert error is not None and "allgather" in error.lower() and "joined" in error, error
    assert [ranks2.get("allgather_while_joined", r)["join"] for r in range(2)] == [1, 1]
    for r in range(2):
        got = ranks2.get("objects_after_join", r)
        assert got["objects"] == [0, 1] and got["gathered"].tolist() == [0, 1]


def _horovod_half_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return (x.float() * torch.tensor(factor, dtype=torch.float64).float()).half()


def test_float16_prescale_and_postscale_match_horovod_bit_for_bit_2ranks(ranks2):
    factor = 0.1915194503788923
    torch.manual_seed(1234)
    base = torch.FloatTensor(8, 8).random_(-100, 100).half()
    inputs = [base + r for r in range(2)]

    def pre_sum(ts):
        return _horovod_half_scale(ts[0], factor) + _horovod_half_scale(ts[1], factor)

    for r in range(2):
        got = ranks2.get("scaled.half", r)
        rows = slice(4 * r, 4 * r + 4)
        assert torch.equal(got["rs_pre"], pre_sum(inputs)[rows])
        assert torch.equal(got["rs_post"], _horovod_half_scale(inputs[0] + inputs[1], factor)[rows])
        for k, g in enumerate(got["grs_pre"]):
            assert torch.equal(g, pre_sum([t + k for t in inputs])[rows]), k
        assert torch.equal(got["ar_pre"], pre_sum(inputs))
        assert torch.equal(got["ar_post"], _horovod_half_scale(inputs[0] + inputs[1], factor / 2))


def test_join_3ranks(ranks3):
    for r in range(3):
        assert ranks3.get("join", r)["join"] == 2
    assert ranks3.get("join", 2)["average"].tolist() == [2.0, 2.0]


def test_process_set_3ranks(ranks3):
    for r in (0, 2):
        got = ranks3.get("process_set", r)
        assert got["included"] and got["size"] == 2 and got["rank_in_set"] == (0 if r == 0 else 1)
        assert got["allreduce"].tolist() == [4.0, 4.0]
        assert got["average"].tolist() == [2.0, 2.0]
        assert got["allgather"].tolist() == [0.0, 2.0]
        assert got["broadcast"].tolist() == [2.0, 2.0]  # root_rank is a global rank
        assert got["alltoall"].tolist() == ([0.0, 20.0] if r == 0 else [1.0, 21.0])
        total = torch.arange(4.0) * 4
        assert got["reducescatter"].tolist() == (total[:2] if r == 0 else total[2:]).tolist()
        assert got["allgather_grad"].tolist() == [1.0, 1.0]  # two members' ones upstream, averaged
        assert got["removed"] is True
    got = ranks3.get("process_set", 1)
    assert not got["included"] and got["alone"].tolist() == [1.0] and got["removed"] is True


# ---- gradients ---------------------------------------------------------------------------------


def test_allreduce_gradients_2ranks(ranks2):
    for r in range(2):
        got = ranks2.get("grad.allreduce", r)
        # y = mean_k((k+1) x_k), loss = sum_k (k+1) sum(y): d/dx_r = (r+1) * sum_k (k+1) / 2
        assert torch.allclose(got["average"], torch.full((3,), (r + 1) * 3 / 2))
        # y = 3 * sum_k(2 x_k): d/dx_r = 6 * sum_k (k+1)
        assert torch.allclose(got["sum_scaled"], torch.full((3,), 18.0))
        assert torch.allclose(got["fp16"], torch.ones(3))  # the averaged ones, as the brief derives
        assert torch.allclose(got["grouped_a"], torch.full((2,), 3.0))
        assert torch.allclose(got["grouped_b"], torch.full((3,), 4.0))


def test_collectives_record_autograd_only_when_needed_2ranks(ranks2):
    for r in range(2):
        for label, got in ranks2.get("grad.modes", r).items():
            assert got == {"recorded": True, "no_grad": True, "plain": True, "same": True}, (r, label)


def _allgather_grad_expected(n: int, r: int) -> torch.Tensor:
    total_rows = sum(k + 1 for k in range(n))
    upstream = torch.arange(total_rows * 2, dtype=torch.float32).reshape(total_rows, 2)
    summed = upstream * sum(k + 1 for k in range(n)) / n  # mean over ranks k of (k+1) * arange
    start = sum(k + 1 for k in range(r))
    return summed[start : start + r + 1]


def test_allgather_gradient(job):
    for r in range(job.size):
        assert torch.allclose(job.get("grad.allgather", r), _allgather_grad_expected(job.size, r))


def test_broadcast_gradient_2ranks(ranks2):
    # root 1 gets the mean of every rank's upstream gradient ((1 + 2) / 2); rank 0 gets zeros
    assert ranks2.get("grad.broadcast", 0).tolist() == [0.0] * 3
    assert ranks2.get("grad.broadcast", 1).tolist() == [1.5] * 3


def test_alltoall_gradient_2ranks(ranks2):
    # even splits: x_k[2j:2j+2] lands on rank j, weighted arange(4)[2k:2k+2] * (j+1)
    assert ranks2.get("grad.alltoall", 0)["even"].tolist() == [0.0, 1.0, 0.0, 2.0]
    assert ranks2.get("grad.alltoall", 1)["even"].tolist() == [2.0, 3.0, 4.0, 6.0]
    # splits [1,2] / [2,1]: rank 0 receives x0[0], x1[0], x1[1]; rank 1 receives x0[1], x0[2], x1[2]
    assert ranks2.get("grad.alltoall", 0)["splits"].tolist() == [0.0, 0.0, 2.0]
    assert ranks2.get("grad.alltoall", 1)["splits"].tolist() == [1.0, 2.0, 4.0]


def test_reducescatter_gradient_2ranks(ranks2):
    # rows 0-2 go to rank 0 (upstream 1), rows 3-4 to rank 1 (upstream 2); Sum scales them by the
    # size (2), Average with prescale 3 by 3.
    for r in range(2):
        got = ranks2.get("grad.reducescatter", r)
        assert got["sum"].tolist() == [2.0, 2.0, 2.0, 4.0, 4.0]
        assert torch.allclose(got["average_prescaled"], torch.tensor([3.0, 3.0, 3.0, 6.0, 6.0]))


def test_grouped_allgather_gradient_2ranks(ranks2):
    # a: rows 0 | 1-2 of a (3, 2) gather weighted arange(6) * (k+1), averaged over k -> 1.5 * arange(6)
    # b: rows 0-1 | 2 of a (3,) gather weighted arange(3) on both ranks -> arange(3)
    assert ranks2.get("grad.grouped_allgather", 0)["requires_grad"]
    assert ranks2.get("grad.grouped_allgather", 0)["a"].tolist() == [[0.0, 1.5]]
    assert ranks2.get("grad.grouped_allgather", 1)["a"].tolist() == [[3.0, 4.5], [6.0, 7.5]]
    assert ranks2.get("grad.grouped_allgather", 0)["b"].tolist() == [0.0, 1.0]
    assert ranks2.get("grad.grouped_allgather", 1)["b"].tolist() == [2.0]


def test_grouped_reducescatter_gradient_2ranks(ranks2):
    # Sum with postscale 2: rank k's block gets upstream 2 (k+1) x size 2; Average: upstream (k+1)
    for r in range(2):
        got = ranks2.get("grad.grouped_reducescatter", r)
        assert got["a"].tolist() == [4.0, 4.0, 4.0, 8.0, 8.0]
        assert got["b"].tolist() == [[4.0] * 3, [8.0] * 3]
        assert got["c"].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_reducescatter_gradient_3ranks(ranks3):
    # 7 rows -> 3, 2, 2; rank k's block has upstream (k+1); Average passes it through
    want = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
    for r in range(3):
        assert torch.allclose(ranks3.get("grad.reducescatter", r), want)
