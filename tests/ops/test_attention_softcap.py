"""Attention-logit soft-capping (Gemma 2: scores c * tanh(s / c) before masks and softmax) against
float64 eager attention, on the C++ kernels (every ISA this CPU runs, both backward schedules) and
on the Triton kernels interpreted; odd shapes, GQA, every mask kind, dropout from the contract."""

import math

import numpy as np
import pytest
import torch

import selective_ckpt
from selective_ckpt import _C, rng
from tests.reference import assert_within_rule, attention_allowed

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors runs interpreted only")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def capped_eager(q, k, v, cap, causal=False, window=0, pad=None, cu=None, p=0.0, seed=0):
    """softmax(c * tanh(q k^T * scale / c) + masks) v in q's dtype, materialised; rows attending nothing give 0."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    s = torch.tanh(s / cap) * cap
    ok = attention_allowed(B, Sq, Sk, causal, window, pad, cu)
    anything = ok.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(anything, s.masked_fill(~ok, -math.inf), 0.0), -1) * anything
    if p > 0:
        probs = probs * rng.attention_keep_mask(seed, B, H, Sq, Sk, p) * rng.keep_scale(p)
    return probs @ v


def _inputs(B, H, Hkv, Sq, Sk, D, dtype, spread):
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(B, H, Sq, D, generator=g) * spread).to(dtype)
    k = (torch.randn(B, Hkv, Sk, D, generator=g) * spread).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    return q, k, v, torch.randn(B, H, Sq, D, generator=g)


def _run(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(grad.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


# (B, H, Hkv, Sq, Sk, D, causal, window, padding, documents, dropout)
CASES = {
    "causal-gqa": (2, 4, 2, 37, 37, 24, True, 0, False, None, 0.0),
    "full-cross": (1, 2, 1, 19, 45, 40, False, 0, False, None, 0.0),
    "window-pad": (2, 2, 2, 33, 33, 16, True, 9, True, None, 0.0),
    "documents": (1, 2, 1, 40, 40, 32, True, 0, False, (13, 20, 7), 0.0),
    "dropout": (2, 2, 1, 29, 29, 24, True, 0, False, None, 0.2),
}


def check(name, dtype, cap=2.0, spread=2.0, case=None):
    B, H, Hkv, Sq, Sk, D, causal, window, padding, docs, p = case or CASES[name]
    q, k, v, grad = _inputs(B, H, Hkv, Sq, Sk, D, dtype, spread)
    pad = None
    if padding:
        pad = torch.rand(B, Sk, generator=torch.Generator().manual_seed(5)) > 0.3
        pad[:, 0] = True
    cu = None if docs is None else [0, *torch.tensor(docs).cumsum(0).tolist()]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    kw = dict(causal=causal, window=window, pad=pad, cu=cu, p=p, seed=77)
    ours = _run(lambda a, b, c: selective_ckpt.attention(a, b, c, causal=causal, dropout_p=p, key_padding_mask=pad,
                                                         seed=77, sliding_window=window or None, cu_seqlens=cu_t,
                                                         softcap=cap), q, k, v, grad)
    eager = _run(lambda a, b, c: capped_eager(a, b, c, cap, **kw), q, k, v, grad)
    ref = _run(lambda a, b, c: capped_eager(a, b, c, cap, **kw), q.double(), k.double(), v.double(), grad)
    for what, x, e, r, factor in zip(("o", "dq", "dk", "dv"), ours, eager, ref, (2, 3, 3, 3)):
        assert_within_rule(x, e, r, factor, name=f"{name} {dtype} {what}")
    if dtype == torch.float32:
        for what, x, r in zip(("o", "dq", "dk", "dv"), ours, ref):
            assert (x.double() - r).abs().max() < 2e-5, what
    return ours, ref


ISAS = ["generic", "avx2", "avx512", "avx512bf16emu", "avx512bf16"]


@pytest.fixture(params=ISAS)
def isa(request):
    try:
        old = _C.attention_use_isa(request.param)
    except ValueError:
        pytest.skip(f"this CPU does not run {request.param}")
    yield request.param
    _C.attention_use_isa(old)


@pytest.fixture(params=[1, 2], ids=["single-pass", "two-pass"])
def passes(request):
    old = _C.attention_backward_passes(request.param)
    yield request.param
    _C.attention_backward_passes(old)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_cpp_softcap_against_float64(name, dtype, isa, passes):
    check(name, dtype)


def test_cap_changes_the_result_and_a_huge_cap_is_none():
    """The cap is applied (a cap of 2 on scores near 6 moves o) and c * tanh(s / c) -> s as c grows."""
    q, k, v, _ = _inputs(1, 2, 2, 21, 21, 16, torch.float32, 3.0)
    plain = selective_ckpt.attention(q, k, v, causal=True)
    capped = selective_ckpt.attention(q, k, v, causal=True, softcap=2.0)
    huge = selective_ckpt.attention(q, k, v, causal=True, softcap=1e6)
    assert (capped - plain).abs().max() > 1e-2
    torch.testing.assert_close(huge, plain, atol=1e-5, rtol=0)


def test_tanh_over_its_whole_range():
    """The kernels' tanh (a polynomial below 0.625, exp above) through scores spanning +-40 caps:
    softcap 1 with wide inputs puts s / c everywhere from 0 to saturation."""
    check("full-cross", torch.float32, cap=1.0, spread=4.0)
    check("causal-gqa", torch.float32, cap=50.0, spread=1.0)


def test_nan_key_poisons_only_its_rows():
    q, k, v, grad = _inputs(1, 1, 1, 8, 8, 16, torch.float32, 1.0)
    k[0, 0, 5, 3] = float("nan")
    o = selective_ckpt.attention(q, k, v, causal=True, softcap=5.0)
    assert torch.isfinite(o[0, 0, :5]).all() and torch.isnan(o[0, 0, 5:]).all()


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_bad_softcap_is_a_value_error(bad):
    q, k, v, _ = _inputs(1, 1, 1, 4, 4, 8, torch.float32, 1.0)
    with pytest.raises(ValueError, match="softcap"):
        selective_ckpt.attention(q, k, v, softcap=bad)
    with pytest.raises(TypeError, match="softcap"):
        selective_ckpt.attention(q, k, v, softcap="5")


@interpreted
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", ["causal-gqa", "window-pad", "dropout"])
def test_triton_softcap_against_float64(name, dtype, monkeypatch):
    monkeypatch.setenv("SELECTIVE_CKPT_BACKEND", "triton")
    check(name, dtype)


@interpreted
def test_triton_softcap_whole_tanh_range(monkeypatch):
    monkeypatch.setenv("SELECTIVE_CKPT_BACKEND", "triton")
    # past |s / c| ~ 44 the kernel's tanh, 1 - 2 / (e^(2|x|) + 1), takes e^(2|x|) = inf and gives 1, as it does
    # on a GPU, silently; the interpreter computes it in numpy, which reports the overflow
    with np.errstate(over="ignore"):
        check("full-cross", torch.float32, cap=1.0, spread=4.0)


@interpreted
def test_triton_softcap_with_the_sm90_tiles(monkeypatch):
    """The tiles a GPU launch takes (soft-capped dK/dV at D <= 64 takes the smaller one: the kept
    tanh tile spilled the larger), interpreted, on a shape with ragged last blocks."""
    from selective_ckpt.triton_kernels import attention as tk

    monkeypatch.setattr(tk, "INTERPRETED", False)
    monkeypatch.setenv("SELECTIVE_CKPT_BACKEND", "triton")
    assert tk.config("dkdv", 64, torch.bfloat16, softcap=True)[:2] == (32, 128)
    assert tk.config("dkdv", 64, torch.bfloat16)[:2] == (64, 128)
    check("sm90-d64", torch.bfloat16, case=(1, 2, 1, 150, 150, 64, True, 0, False, None, 0.0))
    check("sm90-d256", torch.bfloat16, case=(1, 2, 1, 70, 70, 256, True, 0, False, None, 0.1))
