"""LayerNorm op and the fused LN->Linear piece, against float64 eager PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from selective_ckpt import backend, norm_fusion
from selective_ckpt.ops import layer_norm as ln_ops
from tests.reference import assert_within_rule

SHAPES = [(1, 17), (5, 77), (3, 2, 40)]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _inputs(shape, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype)
    b = (0.2 * torch.randn(n, generator=g)).to(dtype) if bias else None
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, dy


def _grads(fn, x, w, b, dy):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_float64_reference(backend, shape, dtype, bias):
    x, w, b, dy = _inputs(shape, dtype, bias)
    n = shape[-1]
    ours = _grads(lambda x, w, b: ln_ops.layer_norm(x, w, b, 1e-5), x, w, b, dy)
    eager = _grads(lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), x, w, b, dy)
    d = lambda t: None if t is None else t.double()
    ref = _grads(lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), d(x), d(w), d(b), d(dy))
    assert_within_rule(ours[0], eager[0], ref[0], 2, name="y")
    for name, o, e, r in zip(("dx", "dw", "db"), ours[1], eager[1], ref[1]):
        assert_within_rule(o, e, r, 3, name=name)
    if dtype == torch.float32:
        torch.testing.assert_close(ours[0], ref[0].float(), atol=1e-5, rtol=1e-5)
        for o, r in zip(ours[1], ref[1]):
            torch.testing.assert_close(o, r.float(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rebuilds_forward_output_bit_for_bit(backend, dtype):
    x, w, b, _ = _inputs((7, 45), dtype, True, seed=3)
    y, mean, rstd = ln_ops.layer_norm_fwd(x, w, b, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (7,)
    assert torch.equal(ln_ops.layer_norm_apply(x, w, b, mean, rstd), y)
    torch.testing.assert_close(mean, x.float().mean(-1), atol=1e-5, rtol=1e-5)


def test_backends_agree():
    x, w, b, dy = _inputs((6, 33), torch.float32, True, seed=5)
    import os

    results = []
    for choice in ("auto", "triton"):
        os.environ[backend.BACKEND_ENV] = choice
        try:
            results.append(_grads(lambda x, w, b: ln_ops.layer_norm(x, w, b), x, w, b, dy))
        finally:
            os.environ.pop(backend.BACKEND_ENV, None)
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-6)
    for a, c in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-6)


def test_saves_input_and_statistics_only():
    x, w, b, _ = _inputs((4, 24), torch.float32, True)
    x.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ln_ops.layer_norm(x, w, b)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == [(4,), (4,), (4, 24), (24,)], shapes  # x, weight, mean, rstd; never y
    assert not any(t.data_ptr() == y.data_ptr() for t in saved)


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_linear_matches_reference(backend, dtype, store):
    x, lw, lb, _ = _inputs((2, 5, 24), dtype, True, seed=7)
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(40, 24, generator=g) / 5).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    dy = torch.randn(2, 5, 40, generator=g).to(dtype)

    def run(fn, *ts):
        leaves = [t.detach().clone().requires_grad_(True) for t in ts]
        out = fn(*leaves)
        out.backward(dy.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    ours = run(lambda x, lw, lb, w, b: norm_fusion.norm_linear(x, lw, lb, [(w, b)], eps=1e-5, store=store),
               x, lw, lb, w, b)
    eager_fn = lambda x, lw, lb, w, b: F.linear(F.layer_norm(x, (24,), lw, lb, 1e-5), w, b)
    eager = run(eager_fn, x, lw, lb, w, b)
    ref = run(eager_fn, *(t.double() for t in (x, lw, lb, w, b)))
    for i, name in enumerate(("out", "dx", "dln_w", "dln_b", "dw", "db")):
        assert_within_rule(ours[i], eager[i], ref[i], 2 if i == 0 else 3, name=name)


def test_norm_linear_store_and_recompute_bit_identical(backend):
    x, lw, lb, _ = _inputs((3, 19), torch.bfloat16, True, seed=11)
    w = torch.randn(10, 19).bfloat16()
    dy = torch.randn(3, 10).bfloat16()
    grads = []
    for store in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (x, lw, lb, w)]
        out = norm_fusion.norm_linear(*leaves[:3], [(leaves[3], None)], store=store)
        out.backward(dy)
        grads.append([out] + [t.grad for t in leaves])
    for a, c in zip(*grads):
        assert torch.equal(a, c)


def test_opcheck_layer_norm_ops():
    x, w, b, dy = _inputs((3, 20), torch.float32, True)
    y, mean, rstd = ln_ops.layer_norm_fwd(x, w, b, 1e-5)
    torch.library.opcheck(ln_ops.layer_norm_fwd, (x.requires_grad_(True), w.requires_grad_(True), b, 1e-5))
    torch.library.opcheck(ln_ops.layer_norm_apply, (x.detach(), w.detach(), b, mean, rstd))
    torch.library.opcheck(ln_ops.layer_norm_bwd, (dy, x.detach(), mean, rstd, w.detach()))


def test_bad_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight must have shape"):
        ln_ops.layer_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="bias must have shape"):
        ln_ops.layer_norm(x, torch.ones(8), torch.ones(3))
    with pytest.raises(ValueError, match="eps"):
        ln_ops.layer_norm(x, torch.ones(8), eps=-1.0)
    with pytest.raises(TypeError, match="x must be"):
        ln_ops.layer_norm(torch.ones(3, 8, dtype=torch.int64), torch.ones(8))
    with pytest.raises(ValueError, match="last dimension"):
        ln_ops.layer_norm(torch.ones(3, 0), torch.ones(0))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_layer_norm_matches_float64_reference(dtype):
    x, w, b, dy = (t.cuda() for t in _inputs((203, 4096), dtype, True))
    ours = _grads(lambda x, w, b: ln_ops.layer_norm(x, w, b), x, w, b, dy)
    eager = _grads(lambda x, w, b: F.layer_norm(x, (4096,), w, b), x, w, b, dy)
    ref = _grads(lambda x, w, b: F.layer_norm(x, (4096,), w, b), x.double(), w.double(), b.double(), dy.double())
    assert_within_rule(ours[0], eager[0], ref[0], 2, name="y")
    for name, o, e, r in zip(("dx", "dw", "db"), ours[1], eager[1], ref[1]):
        assert_within_rule(o, e, r, 3, floor=1e-4, name=name)
    y, mean, rstd = ln_ops.layer_norm_fwd(x, w, b, 1e-5)
    assert torch.equal(ln_ops.layer_norm_apply(x, w, b, mean, rstd), y)


def test_ops_refuse_mismatched_operands_instead_of_reading_past_them():
    # the fused pieces call the ops directly: a weight of the wrong length must be an error, not a crash
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight must be \\[8\\]"):
        ln_ops.layer_norm_fwd(x, torch.ones(5), None, 1e-5)
    with pytest.raises(ValueError, match="bias must be \\[8\\] torch.float32"):
        ln_ops.layer_norm_fwd(x, torch.ones(8), torch.ones(8, dtype=torch.float64), 1e-5)
    y, mean, rstd = ln_ops.layer_norm_fwd(x, torch.ones(8), None, 1e-5)
    with pytest.raises(ValueError, match="rstd must be \\[3\\]"):
        ln_ops.layer_norm_apply(x, torch.ones(8), None, mean, rstd[:2])
    with pytest.raises(ValueError, match="dy must match x"):
        ln_ops.layer_norm_bwd(torch.ones(3, 7), x, mean, rstd, torch.ones(8))
    with pytest.raises(ValueError, match="weight must be \\[8\\]"):
        norm_fusion.norm_linear(x[None], torch.ones(5), None, [(torch.randn(4, 8), None)])
