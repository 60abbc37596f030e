"""The flat buffer behind each gradient bucket of hora.torch.DistributedOptimizer, in one process.

Each bucket's gradients are views of one persistent flat buffer (DDP's ``gradient_as_bucket_view``).
These check the buffer against torch itself, with no job: the views have the layout autograd gives
gradients, autograd then accumulates into them in place, gradients found elsewhere are copied in
once, and the buffer is cut again when the parameters change. The 2-rank behaviour (reductions,
training against per-tensor reductions) is in test_torch_optimizer.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hora.torch.optimizer import _SLOT_ALIGN_BYTES, _BucketBuffer, _gradient_strides, _layout_tag  # noqa: E402


class Ops(TorchDispatchMode):
    """Counts the aten operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def param(make):
    torch.manual_seed(0)
    return torch.nn.Parameter(make())


LAYOUTS = {
    "contiguous": lambda: torch.randn(4, 3, 3, 3),
    "channels_last": lambda: torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last),
    "channels_last_1x1": lambda: torch.randn(4, 3, 1, 1).to(memory_format=torch.channels_last),
    "transposed": lambda: torch.randn(3, 5).t(),
    "strided_slice": lambda: torch.randn(4, 6)[:, ::2],  # not dense: autograd's gradient is row-major
    "expanded": lambda: torch.randn(3, 1).expand(3, 4),  # overlapping: row-major too
    "odd": lambda: torch.randn(7),
}


def loss(params: list):
    g = torch.Generator().manual_seed(1)
    return sum((p * torch.randn(p.shape, generator=g)).sum() for p in params)


def significant(t, strides=None) -> tuple:
    """Strides of the dimensions longer than 1 (those of size-1 dimensions order nothing)."""
    return tuple(s for n, s in zip(t.shape, strides or t.stride()) if n != 1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_views_have_the_layout_autograd_gives_gradients(layout):
    p = param(LAYOUTS[layout])
    loss([p]).backward()
    assert significant(p, _gradient_strides(p)) == significant(p.grad)
    buffer = _BucketBuffer([p, param(LAYOUTS["odd"])])
    buffer.params[1].grad = torch.ones(7)
    want = p.grad.clone()
    flat = buffer.gradients()
    assert flat is not None and torch.equal(p.grad, want)
    assert significant(p.grad) == significant(want)
    assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_autograd_accumulates_into_the_views_and_nothing_is_copied_after():
    params = [param(LAYOUTS[k]) for k in ("channels_last", "transposed", "odd")]
    loss(params).backward()
    buffer = _BucketBuffer(params)
    flat = buffer.gradients()
    views = [p.grad for p in params]
    for p in params:  # zero_grad(set_to_none=False)
        p.grad.zero_()
    loss(params).backward()
    loss(params).backward()  # two passes add up in place (backward_passes_per_step=2)
    with Ops() as ops:
        assert buffer.gradients() is flat
    assert not ops.seen, ops.seen
    assert all(p.grad is v for p, v in zip(params, views))
    reference = [param(LAYOUTS[k]) for k in ("channels_last", "transposed", "odd")]
    loss(reference).backward()
    loss(reference).backward()
    for p, r in zip(params, reference):
        assert torch.equal(p.grad, r.grad)


def test_gradients_outside_the_buffer_are_copied_in_once():
    params = [param(LAYOUTS[k]) for k in ("contiguous", "odd", "transposed")]
    loss(params).backward()
    buffer = _BucketBuffer(params)
    flat = buffer.gradients()
    params[0].grad = None  # zero_grad(): autograd makes a new one
    params[1].grad = torch.full((7,), 0.5)  # assigned by the user
    params[2].grad = None  # unused this step: contributes zeros
    loss(params[:1]).backward()
    want = params[0].grad.clone()
    with Ops() as ops:
        assert buffer.gradients() is flat
    assert ops.seen == {"_foreach_copy_": 1, "_foreach_zero_": 1}, ops.seen
    assert torch.equal(params[0].grad, want) and torch.equal(params[1].grad, torch.full((7,), 0.5))
    assert torch.equal(params[2].grad, torch.zeros(5, 3))
    assert {p.grad.untyped_storage().data_ptr() for p in params} == {flat.untyped_storage().data_ptr()}


def test_slots_are_aligned_and_the_padding_stays_zero():
    params = [param(LAYOUTS["odd"]) for _ in range(3)]
    for p in params:
        p.grad = torch.ones(7)
    flat = _BucketBuffer(params).gradients()
    offsets = [p.grad.storage_offset() * p.grad.element_size() for p in params]
    assert all(offset % _SLOT_ALIGN_BYTES == 0 for offset in offsets), offsets
    assert flat.sum().item() == 21


def test_a_dtype_change_cuts_the_buffer_again():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    loss(params).backward()
    buffer = _BucketBuffer(params)
    buffer.gradients()
    model.double()  # converts each gradient in place (grad.data = ...): the views point elsewhere
    want = [p.grad.clone() for p in params]
    flat = buffer.gradients()
    assert flat.dtype == torch.float64
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
    assert {p.grad.untyped_storage().data_ptr() for p in params} == {flat.untyped_storage().data_ptr()}


def test_a_gradient_repointed_with_data_gets_a_fresh_view():
    params = [param(LAYOUTS["odd"]), param(LAYOUTS["transposed"])]
    loss(params).backward()
    buffer = _BucketBuffer(params)
    flat = buffer.gradients()
    params[0].grad.data = torch.full((7,), 3.0)  # the same tensor object, other memory
    assert buffer.gradients() is flat
    assert torch.equal(flat[:7], torch.full((7,), 3.0))
    assert params[0].grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_a_repointed_view_is_not_reused_for_a_missing_gradient():
    params = [param(LAYOUTS["odd"]), param(LAYOUTS["transposed"])]
    loss(params).backward()
    buffer = _BucketBuffer(params)
    flat = buffer.gradients()
    elsewhere = torch.full((7,), 3.0)
    params[0].grad.data = elsewhere  # the view object now points at other memory...
    params[0].grad = None  # ...and is dropped (zero_grad()), the parameter unused this step
    assert buffer.gradients() is flat
    assert torch.equal(flat[:7], torch.zeros(7)) and torch.equal(elsewhere, torch.full((7,), 3.0))
    assert params[0].grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("case", ["sparse", "records_a_graph", "mixed_dtypes"])
def test_where_a_view_cannot_stand_in_the_caller_copies(case):
    params = [param(LAYOUTS["odd"]), param(lambda: torch.randn(10, 3))]
    if case == "mixed_dtypes":
        params[1].data = params[1].data.double()
    if case == "records_a_graph":  # a gradient that depends on the parameter keeps its graph
        sum((p * p).sum() for p in params).backward(create_graph=True)
    else:
        loss(params).backward()
    if case == "sparse":
        params[1].grad = params[1].grad.to_sparse()
    before = [p.grad for p in params]
    assert _BucketBuffer(params).gradients() is None
    assert all(p.grad is g for p, g in zip(params, before))  # left as they were


def test_the_layout_tag_names_element_orders_other_than_row_major():
    def tag(*makes) -> str:
        return _layout_tag([(p.shape, _gradient_strides(p), 0) for p in (param(m) for m in makes)])

    assert tag(LAYOUTS["contiguous"], LAYOUTS["odd"]) == ""
    assert tag(LAYOUTS["channels_last_1x1"]) == ""  # the same order as row-major
    assert tag(LAYOUTS["channels_last"]) != "" and tag(LAYOUTS["channels_last"]) != tag(LAYOUTS["transposed"])
