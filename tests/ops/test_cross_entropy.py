"""linear_cross_entropy against float64 F.linear + F.cross_entropy, judged by tests/reference.py's rule
against the same computation in the input dtype (transformers' head: logits in the input dtype,
upcast to float32 for the loss). Both backends (Triton under the interpreter on these tiny shapes),
odd N, V not a multiple of the chunk, every reduction, label smoothing, soft-capping,
num_items_in_batch, fully ignored batches, frozen operands, bad arguments, opcheck of the kernel op,
and the memory contract: what forward keeps and the step's peak, from the allocator's own events."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from selective_ckpt.memory.estimate import loss_head_estimate
from selective_ckpt.memory.peak import cpu_allocation_deltas, running_peak
from selective_ckpt.ops.cross_entropy import chunk_rows, cross_entropy_rows_op, linear_cross_entropy
from tests.reference import assert_within_rule

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def head_loss(x, w, b, y, reduction="mean", label_smoothing=0.0, softcap=None, num_items=None, dtype=None):
    """transformers' head and loss in `dtype` (float64 for the reference): logits, cap, upcast, loss."""
    dtype = dtype or x.dtype
    z = F.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap  # Gemma-2's final_logit_softcapping, in the head's dtype
    z = z if dtype == torch.float64 else z.float()
    if num_items is not None:
        return F.cross_entropy(z, y, reduction="sum", label_smoothing=label_smoothing) / num_items
    return F.cross_entropy(z, y, reduction=reduction, label_smoothing=label_smoothing)


def make(n, h, v, dtype, bias, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5 * 3).to(dtype)
    b = (torch.randn(v, generator=g, dtype=torch.float64)).to(dtype) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        y[::ignore_every] = -100
    return x, w, b, y


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def check_case(x, w, b, y, chunk_bytes=None, **kw):
    dtype = x.dtype
    ours_in, eager_in, ref_in = leaves(x, w, b), leaves(x, w, b), leaves(*(None if t is None else t.double()
                                                                              for t in (x, w, b)))
    loss = linear_cross_entropy(*ours_in[:2], y, ours_in[2], chunk_bytes=chunk_bytes, **kw)
    loss_eager = head_loss(*eager_in, y, **kw)
    loss_ref = head_loss(*ref_in, y, dtype=torch.float64, **kw)
    assert loss.dtype == torch.float32 and loss.shape == loss_eager.shape
    assert_within_rule(loss, loss_eager, loss_ref, 2, name="loss")
    if dtype == torch.float32:
        torch.testing.assert_close(loss.double(), loss_ref, atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(7)
    g64 = torch.randn(loss.shape, generator=gen, dtype=torch.float64) if loss.dim() else torch.tensor(1.7,
                                                                                                      dtype=torch.float64)
    g64 = g64.to(loss.device)
    inputs = [(t, e, r) for t, e, r in zip(ours_in, eager_in, ref_in) if t is not None]
    ours = torch.autograd.grad(loss, [t for t, _, _ in inputs], g64.float())
    eager = torch.autograd.grad(loss_eager, [e for _, e, _ in inputs], g64.float())
    ref = torch.autograd.grad(loss_ref, [r for _, _, r in inputs], g64)
    for name, a, e, r in zip(("dhidden", "dweight", "dbias"), ours, eager, ref):
        assert a.dtype == dtype
        # Floor: one ulp at the gradient's scale (a bias gradient of a few rows is a short rounded sum,
        # where eager's rounding may land nearer by luck).
        ulp = torch.finfo(dtype).eps * r.abs().max().item()
        assert_within_rule(a, e, r, 3, floor=max(1e-5, ulp), name=name)
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-4)
    return loss


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(backend, dtype, reduction, bias):
    n, h, v = 37, 16, 53
    x, w, b, y = make(n, h, v, dtype, bias)
    # 8 rows per chunk: 5 chunks, the last one 5 rows long.
    check_case(x, w, b, y, chunk_bytes=8 * v * x.element_size(), reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing,softcap", [(0.1, None), (0.0, 4.0), (0.25, 2.5)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_smoothing_and_softcap(backend, dtype, smoothing, softcap, reduction):
    x, w, b, y = make(29, 16, 41, dtype, True, seed=1)
    check_case(x, w, b, y, chunk_bytes=7 * 41 * x.element_size(), reduction=reduction, label_smoothing=smoothing,
               softcap=softcap)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_matches_float64(dtype, reduction):
    """The compiled Triton kernel on a GPU: several chunks, a ragged last one, smoothing and a cap."""
    x, w, b, y = make(257, 64, 1000, dtype, True, seed=11)
    check_case(*(t.cuda() for t in (x, w, b, y)), chunk_bytes=64 * 1000 * x.element_size(), reduction=reduction,
               label_smoothing=0.1, softcap=30.0)


@pytest.mark.parametrize("num_items", [23, "tensor"])
def test_num_items_in_batch(backend, num_items):
    x, w, b, y = make(31, 8, 19, torch.float32, False, seed=2)
    n = torch.tensor(23) if num_items == "tensor" else num_items
    ours_in, ref_in = leaves(x, w), leaves(x.double(), w.double())
    loss = linear_cross_entropy(*ours_in, y, num_items_in_batch=n, chunk_bytes=4 * 19 * 4)
    ref = head_loss(*ref_in, None, y, num_items=n, dtype=torch.float64)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(torch.autograd.grad(loss, ours_in), torch.autograd.grad(ref, ref_in)):
        torch.testing.assert_close(a.double(), r, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("sum", None), ("none", None), ("mean", 5)])
def test_fully_ignored_batch(backend, reduction, num_items):
    """What transformers gives: NaN for the mean of nothing, 0 otherwise, and zero gradients."""
    x, w, b, y = make(9, 8, 13, torch.float32, True, seed=3)
    y[:] = -100
    ours_in, eager_in = leaves(x, w, b), leaves(x, w, b)
    loss = linear_cross_entropy(*ours_in[:2], y, ours_in[2], reduction=reduction, num_items_in_batch=num_items)
    eager = head_loss(*eager_in, y, reduction=reduction, num_items=num_items)
    torch.testing.assert_close(loss, eager, equal_nan=True)
    g = torch.ones_like(loss)
    for a, e in zip(torch.autograd.grad(loss, ours_in, g), torch.autograd.grad(eager, eager_in, g)):
        torch.testing.assert_close(a, e, equal_nan=True)
        assert not a.abs().sum()


def test_custom_ignore_index_and_int32_labels(backend):
    x, w, b, y = make(21, 8, 11, torch.float32, False, seed=4, ignore_every=0)
    y[::3] = 7  # a real class used as ignore_index
    ours_in, ref_in = leaves(x, w), leaves(x.double(), w.double())
    loss = linear_cross_entropy(*ours_in, y.int(), ignore_index=7)
    ref = F.cross_entropy(F.linear(*ref_in), y, ignore_index=7)
    torch.testing.assert_close(loss.double(), ref, atol=1e-6, rtol=1e-5)
    for a, r in zip(torch.autograd.grad(loss, ours_in), torch.autograd.grad(ref, ref_in)):
        torch.testing.assert_close(a.double(), r, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("frozen", ["hidden", "weight", "both"])
def test_frozen_operands(frozen):
    x, w, b, y = make(17, 8, 23, torch.float32, True, seed=5)
    xs, ws, bs = leaves(x, w, b)
    if frozen in ("hidden", "both"):
        xs.requires_grad_(False)
    if frozen in ("weight", "both"):
        ws.requires_grad_(False)
    loss = linear_cross_entropy(xs, ws, y, bs, chunk_bytes=5 * 23 * 4)
    loss.backward()
    ref_in = leaves(x.double(), w.double(), b.double())
    head_loss(*ref_in, y, dtype=torch.float64).backward()
    for ours, ref in zip((xs, ws, bs), ref_in):
        if ours.requires_grad:
            torch.testing.assert_close(ours.grad.double(), ref.grad, atol=1e-6, rtol=1e-5)
        else:
            assert ours.grad is None


def test_no_grad_and_repeatable():
    x, w, b, y = make(33, 8, 29, torch.bfloat16, True, seed=6)
    with torch.no_grad():
        a = linear_cross_entropy(x, w.requires_grad_(True), y, b)
    assert not a.requires_grad
    ours_in = leaves(x, w, b)
    l1 = linear_cross_entropy(*ours_in[:2], y, ours_in[2], chunk_bytes=6 * 29 * 2)
    g1 = torch.autograd.grad(l1, ours_in)
    l2 = linear_cross_entropy(*ours_in[:2], y, ours_in[2], chunk_bytes=6 * 29 * 2)
    g2 = torch.autograd.grad(l2, ours_in)
    assert torch.equal(l1, l2) and torch.equal(a, l1.detach())
    assert all(torch.equal(p, q) for p, q in zip(g1, g2))


def test_non_finite_logits(backend):
    """A NaN logit makes its row's loss NaN; a -inf logit (a masked class) is just excluded."""
    x, w, b, y = make(6, 4, 9, torch.float32, True, seed=8, ignore_every=0)
    b[3] = float("-inf")
    y[y == 3] = 4
    ref = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), y, reduction="none")
    # the kernels take the -inf logit through exp and log as IEEE arithmetic does (and the NaN through every
    # step): silent on a GPU and in C++; the Triton interpreter runs them in numpy, which reports those steps
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = linear_cross_entropy(x, w, y, b, reduction="none")
        torch.testing.assert_close(loss.double(), ref, atol=1e-6, rtol=1e-5)
        x[2, 0] = float("nan")
        loss = linear_cross_entropy(x, w, y, b, reduction="none")
    assert loss[2].isnan() and torch.isfinite(loss[[0, 1, 3, 4, 5]]).all()


def test_autocast_computes_in_autocast_dtype():
    x, w, b, y = make(19, 16, 21, torch.float32, True, seed=9)
    ours_in, eager_in = leaves(x, w, b), leaves(x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(*ours_in[:2], y, ours_in[2])
        eager = F.cross_entropy(F.linear(*eager_in).float(), y)
    ref_in = leaves(x.double(), w.double(), b.double())
    ref = head_loss(*ref_in, y, dtype=torch.float64)
    assert_within_rule(loss, eager, ref, 2, name="loss")
    for a, e, r in zip(torch.autograd.grad(loss, ours_in), torch.autograd.grad(eager, eager_in),
                       torch.autograd.grad(ref, ref_in)):
        assert a.dtype == torch.float32
        assert_within_rule(a, e, r, 3, floor=max(1e-5, 2**-8 * r.abs().max().item()))


def test_bad_arguments():
    x, w, b, y = make(5, 4, 7, torch.float32, True)
    cases = [
        (dict(hidden=x[None]), ValueError, "hidden must be"),
        (dict(weight=w.double()), TypeError, "weight has dtype"),
        (dict(weight=w[:, :3]), ValueError, "weight must have shape"),
        (dict(bias=b[:3]), ValueError, "bias must have shape"),
        (dict(labels=y.float()), TypeError, "labels must be an integer"),
        (dict(labels=y[:3]), ValueError, "labels must have shape"),
        (dict(labels=torch.full((5,), 7)), ValueError, r"labels must be in \[0, 7\)"),
        (dict(reduction="avg"), ValueError, "reduction must be"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(reduction="none", num_items_in_batch=3), ValueError, "num_items_in_batch"),
        (dict(ignore_index=1.0), TypeError, "ignore_index"),
        (dict(chunk_bytes=0), ValueError, "chunk_bytes"),
    ]
    for change, err, match in cases:
        kw = dict(hidden=x, weight=w, labels=y, bias=b) | change
        with pytest.raises(err, match=match):
            linear_cross_entropy(**kw)


def test_chunk_rows():
    assert chunk_rows(512, 32000, 64, 4) == 64  # the weight's 8 MiB over 128000-byte rows
    assert chunk_rows(8192, 128256, 4096, 2) == (256 << 20) // (128256 * 2)  # capped at 256 MiB
    assert chunk_rows(3, 100, 8, 4) == 3  # never more than N
    assert chunk_rows(10, 1 << 30, 8, 4, chunk_bytes=1) == 1  # never fewer than 1


@pytest.mark.parametrize("write_grad", [False, True])
def test_opcheck(backend, write_grad):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 11, generator=g)
    y = torch.tensor([1, -100, 3, 10, 0, 5])
    for scale in (torch.tensor([0.5]), torch.rand(6, generator=g)):
        torch.library.opcheck(cross_entropy_rows_op, (z.clone(), y, scale, -100, 0.1, 0.0, write_grad))


def _step_memory(fn_forward):
    """(bytes alive after forward, peak over forward + backward) from the allocator's events."""
    state = {}

    def forward():
        state["loss"] = fn_forward()

    fwd = cpu_allocation_deltas(forward)
    if fwd is None:
        pytest.skip("the profiler's raw allocator events are not available")
    bwd = cpu_allocation_deltas(lambda: state.pop("loss").backward())
    return sum(fwd), max(running_peak(fwd), sum(fwd) + running_peak(bwd))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_memory_kept_and_peak(reduction):
    """N = 512, V = 32000, h = 64, float32: transformers' head keeps N x V fp32 logits after forward
    (4 B per token per vocabulary entry) and peaks near 3 x that; ours keeps only the gradients backward
    returns (dhidden, dweight; "none": nothing but its own [N] loss) and peaks within the chunk bound."""
    n, h, v = 512, 64, 32000
    x, w, _, y = make(n, h, v, torch.float32, False, seed=10)
    x.requires_grad_(True)
    w.requires_grad_(True)
    kept, peak = _step_memory(lambda: (lambda loss: loss.sum())(linear_cross_entropy(x, w, y, reduction=reduction))
                              if reduction == "none" else linear_cross_entropy(x, w, y))
    grads = (n * h + v * h) * 4
    chunk = chunk_rows(n, v, h, 4) * v * 4
    slack = 64 << 10  # per-row statistics, labels, the loss and allocator rounding
    if reduction == "none":
        assert kept <= n * 16 + slack, kept
    else:
        assert kept <= grads + slack, kept
        assert kept / (n * v) <= 0.52
    # Peak: the gradients, one chunk of logits and its per-row statistics; never N x V. Liger Kernel's
    # fused linear cross-entropy peaks at 16 MiB here, transformers' head at 188 MiB.
    assert peak <= grads + chunk + slack, (peak, grads, chunk)
    assert peak <= 16 << 20
    estimate = loss_head_estimate(n, v, h, torch.float32, reduction, breakdown=True)
    assert estimate["chunk"] == chunk
    assert abs(kept - sum(b for k, b in estimate.items() if k not in ("chunk", "accumulator"))) <= slack
    assert peak < n * v * 4 / 3  # under a third of one copy of the fp32 logits
