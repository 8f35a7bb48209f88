"""RMSNorm op (Llama and Gemma forms, per-head shapes) against float64 eager references written here."""

import pytest
import torch

from selective_ckpt import rms_norm
from selective_ckpt.ops import rms_norm as rms_ops
from tests.reference import assert_within_rule

EPS = 1e-6


def llama_rms_norm(x, w, eps=EPS):
    """Hugging Face LlamaRMSNorm's arithmetic: normalise in fp32, cast to x's dtype, times w."""
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xn.to(x.dtype)


def gemma_rms_norm(x, w, eps=EPS):
    """Hugging Face GemmaRMSNorm's arithmetic: (x_hat * (1 + w)) in fp32, cast once."""
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xn * (1.0 + w.to(xn.dtype))).to(x.dtype)


REFERENCES = {0.0: llama_rms_norm, 1.0: gemma_rms_norm}


def _inputs(shape, dtype, offset, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype)
    w = ((0.0 if offset else 1.0) + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, dy


def _grads(fn, x, w, dy):
    x, w = (t.detach().clone().requires_grad_(True) for t in (x, w))
    y = fn(x, w)
    if dy is None:
        y.sum().backward()  # a stride-0 output gradient
    else:
        y.backward(dy)
    return y.detach(), x.grad, w.grad


def _check(shape, dtype, offset, sum_grad=False):
    x, w, dy = _inputs(shape, dtype, offset)
    dy = None if sum_grad else dy
    ref_fn = REFERENCES[offset]
    ours = _grads(lambda x, w: rms_norm(x, w, EPS, offset=offset), x, w, dy)
    eager = _grads(ref_fn, x, w, dy)
    ref = _grads(ref_fn, x.double(), w.double(), None if dy is None else dy.double())
    for i, name in enumerate(("y", "dx", "dw")):
        assert_within_rule(ours[i], eager[i], ref[i], 2 if i == 0 else 3, name=name)
    if dtype == torch.float32:
        torch.testing.assert_close(ours[0], ref[0].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[1], ref[1].float(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 1), (5, 17), (2, 3, 341)])
def test_rms_norm_matches_float64_reference(backend, shape, dtype, offset):
    _check(shape, dtype, offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_wide_row_and_sum_gradient(dtype):
    _check((3, 4231), dtype, 0.0, sum_grad=True)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_sum_gradient_both_backends(backend, offset):
    _check((4, 33), torch.bfloat16, offset, sum_grad=True)


def test_per_head_norm_over_head_dim(backend):
    # Qwen3's q_norm / k_norm: one weight of size head_dim over [B, S, H, D].
    _check((2, 7, 3, 16), torch.bfloat16, 0.0)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_apply_rebuilds_forward_output_bit_for_bit(backend, dtype, offset):
    x, w, _ = _inputs((7, 45), dtype, offset, seed=3)
    y, rstd = rms_ops.rms_norm_fwd(x, w, EPS, offset)
    assert rstd.dtype == torch.float32 and rstd.shape == (7,)
    assert torch.equal(rms_ops.rms_norm_apply(x, w, rstd, offset), y)
    torch.testing.assert_close(rstd, torch.rsqrt(x.double().pow(2).mean(-1) + EPS).float(), atol=0, rtol=1e-6)


def test_llama_form_matches_eager_bits_in_fp32():
    # Only the statistics' summation order differs from eager in fp32: equal to a few ulps.
    x, w, _ = _inputs((6, 64), torch.float32, 0.0)
    torch.testing.assert_close(rms_norm(x, w, EPS), llama_rms_norm(x, w), atol=1e-6, rtol=1e-6)


def test_backends_agree(use_backend):
    x, w, dy = _inputs((6, 33), torch.float32, 0.0, seed=5)
    results = []
    for choice in ("cpp", "triton"):
        use_backend(choice)
        results.append(_grads(lambda x, w: rms_norm(x, w), x, w, dy))
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-6)


def test_keeps_input_and_rstd_only():
    x, w, _ = _inputs((4, 24), torch.bfloat16, 0.0)
    x.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rms_norm(x, w)
    shapes = sorted((tuple(t.shape), t.dtype) for t in saved)
    assert shapes == sorted([((4, 24), torch.bfloat16), ((24,), torch.bfloat16), ((4,), torch.float32)])


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_opcheck(backend, offset):
    x, w, dy = _inputs((3, 17), torch.float32, offset)
    y, rstd = rms_ops.rms_norm_fwd(x, w, EPS, offset)
    torch.library.opcheck(rms_ops.rms_norm_fwd, (x.requires_grad_(True), w, EPS, offset))
    torch.library.opcheck(rms_ops.rms_norm_apply, (x.detach(), w, rstd, offset))
    torch.library.opcheck(rms_ops.rms_norm_bwd, (dy, x.detach(), rstd, w, offset))


@pytest.mark.parametrize("args,err,match", [
    ((torch.ones(3, 4), torch.ones(5)), ValueError, "weight must have shape \\[4\\]"),
    ((torch.ones(3, 0), torch.ones(0)), ValueError, "non-empty last dimension"),
    ((torch.ones(3, 4, dtype=torch.int32), torch.ones(4)), TypeError, "x must be"),
    (("x", torch.ones(4)), TypeError, "x must be a torch.Tensor"),
])
def test_rejects_bad_arguments(args, err, match):
    with pytest.raises(err, match=match):
        rms_norm(*args)


def test_rejects_bad_eps_and_offset():
    with pytest.raises(ValueError, match="eps"):
        rms_norm(torch.ones(2, 3), torch.ones(3), eps=0.0)
    with pytest.raises(TypeError, match="offset"):
        rms_norm(torch.ones(2, 3), torch.ones(3), offset="gemma")


def test_double_backward_is_a_clear_error():
    x, w, _ = _inputs((3, 8), torch.float32, 0.0)
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(rms_norm(x, w).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="selective_ckpt.rms_norm does not support double backward"):
        gx.sum().backward()


def test_ops_refuse_operands_the_kernels_would_misread():
    x, w, dy = _inputs((3, 8), torch.float32, 0.0)
    _, rstd = rms_ops.rms_norm_fwd(x, w, EPS, 0.0)
    with pytest.raises(ValueError, match="rms norm weight must be \\[8\\]"):
        rms_ops.rms_norm_fwd(x, torch.ones(5), EPS, 0.0)
    with pytest.raises(ValueError, match="rms norm weight"):
        rms_ops.rms_norm_apply(x, w.double(), rstd, 0.0)
    with pytest.raises(ValueError, match="rms norm rstd"):
        rms_ops.rms_norm_apply(x, w, rstd[:2], 0.0)
    with pytest.raises(ValueError, match="rms norm dy"):
        rms_ops.rms_norm_bwd(dy[:, :4], x, rstd, w, 0.0)
