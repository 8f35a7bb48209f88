"""linear_cross_entropy's eager path (the kernel called on the pass's own buffers) gives the bits of the custom op's
dispatcher path, one chunk or several; and the label check names the first bad label whatever the values, on both of
its paths: one C++ pass over plain CPU labels, tensor ops elsewhere (here: under a dispatch mode)."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from selective_ckpt.ops.cross_entropy import check_labels, linear_cross_entropy


class _Dispatched(TorchDispatchMode):
    """Runs every op as it is, counting the cross-entropy kernel op: the dispatcher path of the custom op."""

    def __init__(self):
        super().__init__()
        self.kernel_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "cross_entropy_rows_" in str(func):
            self.kernel_calls += 1
        return func(*args, **(kwargs or {}))


def _run(dtype, bias, chunk_bytes, reduction, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(50, 16, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(50, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, 50, (37,), generator=g)
    y[::4] = -100
    loss = linear_cross_entropy(x, w, y, b, reduction=reduction, chunk_bytes=chunk_bytes, **kw)
    (loss * torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)).sum().backward()
    return [loss.detach()] + [t.grad for t in (x, w, b) if t is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_bytes", [None, 10 * 50 * 4], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("reduction,kw", [("mean", {}), ("sum", {}), ("none", {}), ("mean", {"softcap": 3.0}),
                                          ("sum", {"num_items_in_batch": 21})])
def test_eager_path_gives_the_dispatcher_bits(dtype, bias, chunk_bytes, reduction, kw):
    eager = _run(dtype, bias, chunk_bytes, reduction, **kw)
    with _Dispatched() as mode:
        dispatched = _run(dtype, bias, chunk_bytes, reduction, **kw)
    assert mode.kernel_calls > 0
    for a, b in zip(eager, dispatched, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("labels,ignore_index,bad", [
    ([3, -100, 9, 10, 2], -100, (10, 3)),     # one past the vocabulary
    ([3, -100, -1, 2, 2], -100, (-1, 2)),     # negative, not ignore_index
    ([-101, -100, 3, 2, 2], -100, (-101, 0)),  # below ignore_index
    ([3, 5, 11, 5, 0], 5, (11, 2)),           # ignore_index inside the vocabulary
    ([3, 12, 4, -100, 0], 12, (-100, 3)),     # ignore_index above the vocabulary
])
@pytest.mark.parametrize("path", ["host pass", "tensor ops"])
def test_bad_labels_are_named(labels, ignore_index, bad, path):
    value, position = bad
    with _Dispatched() if path == "tensor ops" else contextlib.nullcontext():
        with pytest.raises(ValueError, match=rf"labels must be in \[0, 10\) or ignore_index \({ignore_index}\); "
                                             rf"got {value} at position {position}"):
            check_labels(torch.tensor(labels), 10, ignore_index)
        x, w = torch.randn(5, 4), torch.randn(10, 4)
        with pytest.raises(ValueError, match=rf"got {value} at position {position}"):
            linear_cross_entropy(x, w, torch.tensor(labels), ignore_index=ignore_index)


@pytest.mark.parametrize("labels,ignore_index,vocab", [
    ([0, 9, -100, 5], -100, 10), ([5, 5, 5, 5], 5, 10), ([12, 0, 9, 12], 12, 10), ([-100] * 4, -100, 0),
    ([], -100, 10),
])
@pytest.mark.parametrize("path", ["host pass", "tensor ops"])
def test_valid_labels_pass(labels, ignore_index, vocab, path):
    y = torch.tensor(labels, dtype=torch.long)
    with _Dispatched() if path == "tensor ops" else contextlib.nullcontext():
        assert check_labels(y.int(), vocab, ignore_index).dtype == torch.int64


@pytest.mark.parametrize("num_items_in_batch", [None, 7, torch.tensor(7)])
def test_the_mean_counts_the_labels_alike_on_both_paths(num_items_in_batch):
    """The mean's denominator: the host pass's count (an int) and the tensor ops' count give the same bits."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(23, 8, generator=g, requires_grad=True), torch.randn(31, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 31, (23,), generator=g)
    y[1::3] = -100
    got = []
    for path in ("host pass", "tensor ops"):
        with _Dispatched() if path == "tensor ops" else contextlib.nullcontext():
            loss = linear_cross_entropy(x, w, y, num_items_in_batch=num_items_in_batch)
            dx, dw = torch.autograd.grad(loss, (x, w))
        got.append((loss, dx, dw))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
    reference = torch.nn.functional.cross_entropy(x.double() @ w.double().t(), y, reduction="sum")
    assert torch.allclose(got[0][0].double(), reference / (num_items_in_batch or int((y != -100).sum())), rtol=1e-5)
