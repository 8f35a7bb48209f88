"""attention(..., q_offset=s): query row i stands at key position i + s.

A query tile q[:, :, s:e] against k[:, :, :e], v[:, :, :e] with q_offset=s is judged twice: against
float64 eager attention built here from the bottom-right rows of the masks (tests/reference.py's
attention_allowed with q_offset) and the contract's dropout mask of rows s..e-1 (rng), with the
project's rule (2x outputs / 3x gradients the error of eager attention in the same dtype); and
against the untiled call (rows of the output equal, dK/dV of the tiles summed in fp32 equal the
untiled ones within rounding). On the C++ kernels and on the Triton kernels interpreted.
"""

import math

import pytest
import torch

import selective_ckpt
from selective_ckpt import rng
from selective_ckpt.ops import attention as attention_ops
from tests.reference import assert_within_rule, attention_allowed

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors runs interpreted only")


def eager_offset(q, k, v, q_offset=0, causal=False, window=0, pad=None, cu=None, cap=0.0, p=0.0, seed=0, scale=None):
    """Materialised attention in q's dtype: query row i at key position i + q_offset, GQA by repeating
    k and v, soft-capping, the contract's dropout mask of global rows q_offset ... q_offset + Sq."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if cap:
        s = torch.tanh(s / cap) * cap
    ok = attention_allowed(B, Sq, Sk, causal, window, pad, cu, q_offset=q_offset)
    anything = ok.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(anything, s.masked_fill(~ok, -math.inf), 0.0), -1) * anything
    if p > 0:
        keep = rng.attention_keep_mask(seed, B, H, q_offset + Sq, Sk, p)[:, :, q_offset:]
        probs = probs * keep * rng.keep_scale(p)
    return probs @ v


def _inputs(B, H, Hkv, Sq, Sk, D, dtype, gen_seed=0, Dv=None):
    """q, k of head dim D, v (and the output's gradient) of Dv (D unless given)."""
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(gen_seed)
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, Dv, generator=g).to(dtype)
    return q, k, v, torch.randn(B, H, Sq, Dv, generator=g)


def _pad(B, Sk, gen_seed=5):
    pad = torch.rand(B, Sk, generator=torch.Generator().manual_seed(gen_seed)) > 0.3
    pad[:, 0] = True
    return pad


def _cu(docs):
    return None if docs is None else [0, *torch.tensor(docs).cumsum(0).tolist()]


def _run(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(grad.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


def _ours(q_offset, causal, window, pad, cu, cap, p, seed, device="cpu"):
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    return lambda a, b, c: selective_ckpt.attention(a, b, c, causal=causal, dropout_p=p, key_padding_mask=pad,
                                                    seed=seed, sliding_window=window or None, cu_seqlens=cu_t,
                                                    softcap=cap or None, q_offset=q_offset)


def check_against_reference(case, dtype, seed=77, Dv=None):
    """Our q_offset call against the float64 reference, under the rule; fp32 also within 2e-5. Dv: v's head dim
    when it differs from q and k's."""
    B, H, Hkv, Sq, Sk, D, off, causal, window, padding, docs, cap, p = case
    q, k, v, grad = _inputs(B, H, Hkv, Sq, Sk, D, dtype, Dv=Dv)
    pad = _pad(B, Sk) if padding else None
    cu = _cu(docs)
    kw = dict(q_offset=off, causal=causal, window=window, pad=pad, cu=cu, cap=cap, p=p, seed=seed)
    ours = _run(_ours(off, causal, window, pad, cu, cap, p, seed), q, k, v, grad)
    eager = _run(lambda a, b, c: eager_offset(a, b, c, **kw), q, k, v, grad)
    ref = _run(lambda a, b, c: eager_offset(a, b, c, **kw), q.double(), k.double(), v.double(), grad)
    for what, x, e, r, factor in zip(("o", "dq", "dk", "dv"), ours, eager, ref, (2, 3, 3, 3)):
        assert_within_rule(x, e, r, factor, name=f"{dtype} {what}")
    if dtype == torch.float32:
        for what, x, r in zip(("o", "dq", "dk", "dv"), ours, ref):
            assert (x.double() - r).abs().max() < 2e-5, what
    return ours


# (B, H, Hkv, Sq, Sk, D, q_offset, causal, window, padding, documents, softcap, dropout)
CPP_CASES = {
    "one-row-last": (2, 2, 1, 1, 77, 64, 76, True, 0, False, None, 0.0, 0.17),
    "one-row-first": (1, 2, 2, 1, 33, 16, 0, True, 0, False, None, 0.0, 0.0),
    "one-row-middle": (1, 4, 2, 1, 113, 80, 57, True, 9, True, None, 0.0, 0.17),
    "middle-causal-gqa": (2, 4, 2, 77, 203, 64, 61, True, 0, False, None, 0.0, 0.17),
    "bottom-causal": (1, 2, 1, 113, 203, 128, 90, True, 0, True, None, 0.0, 0.0),
    "middle-window": (2, 2, 2, 37, 113, 80, 40, True, 17, False, None, 0.0, 0.17),
    "window-not-causal": (1, 3, 1, 17, 77, 16, 30, False, 11, True, None, 0.0, 0.0),
    "not-causal-padded": (2, 2, 1, 33, 77, 64, 44, False, 0, True, None, 0.0, 0.17),
    "documents-crossing": (1, 4, 2, 45, 203, 80, 120, True, 0, False, (50, 77, 3, 40, 33), 0.0, 0.17),
    "documents-window": (1, 2, 1, 60, 150, 16, 70, True, 13, False, (17, 60, 1, 72), 0.0, 0.0),
    "documents-not-causal": (1, 2, 2, 29, 77, 128, 48, False, 0, False, (30, 20, 27), 0.0, 0.17),
    "softcap": (2, 4, 2, 41, 113, 64, 72, True, 0, False, None, 20.0, 0.0),
    "softcap-dropout-window": (1, 2, 1, 50, 130, 80, 60, True, 31, True, None, 30.0, 0.17),
    "zero-offset-short": (1, 2, 1, 33, 77, 16, 0, True, 0, False, None, 0.0, 0.17),
}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", list(CPP_CASES))
def test_cpp_offset_matches_reference(name, dtype, use_backend):
    use_backend("cpp")
    check_against_reference(CPP_CASES[name], dtype)


def test_cpp_offset_fp16(use_backend):
    use_backend("cpp")
    check_against_reference(CPP_CASES["documents-crossing"], torch.float16)


TRITON_CASES = {
    "one-row": (1, 2, 1, 1, 33, 16, 20, True, 0, False, None, 0.0, 0.17),
    "middle-causal-gqa": (1, 4, 2, 13, 30, 16, 17, True, 0, True, None, 0.0, 0.17),
    "bottom-window": (1, 2, 2, 19, 45, 24, 26, True, 7, False, None, 0.0, 0.0),
    "window-not-causal": (1, 2, 1, 17, 40, 16, 13, False, 9, True, None, 0.0, 0.17),
    "documents-crossing": (1, 2, 1, 23, 50, 16, 20, True, 0, False, (13, 17, 1, 19), 0.0, 0.17),
    "documents-not-causal": (1, 2, 2, 18, 41, 16, 21, False, 5, False, (25, 16), 0.0, 0.0),
    "softcap": (1, 2, 1, 20, 47, 24, 27, True, 0, False, None, 20.0, 0.17),
}


@interpreted
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_offset_matches_reference(name, dtype, use_backend):
    use_backend("triton")
    check_against_reference(TRITON_CASES[name], dtype)


def _tiled_and_untiled(Q, K, V, grad, bounds, causal, window, pad, docs, cap, p, seed):
    """The untiled call and the tiles [s, e) of `bounds` (q = Q[s:e], k, v = K, V[:e], q_offset = s):
    (untiled o, dq, dk, dv), (tiles' o concatenated, dq concatenated, dk and dv summed in fp32)."""
    cu = _cu(docs)
    device = Q.device.type
    full = _run(_ours(0, causal, window, pad, cu, cap, p, seed, device), Q, K, V, grad)
    outs, dqs = [], []
    dk = torch.zeros(K.shape, dtype=torch.float32, device=device)
    dv = torch.zeros(V.shape, dtype=torch.float32, device=device)
    for s, e in zip(bounds, bounds[1:]):
        cu_e = None if cu is None else [min(c, e) for c in cu]  # the documents of keys 0 ... e
        pad_e = None if pad is None else pad[:, :e]
        o, dq_t, dk_t, dv_t = _run(_ours(s, causal, window, pad_e, cu_e, cap, p, seed, device), Q[:, :, s:e],
                                   K[:, :, :e], V[:, :, :e], grad[:, :, s:e])
        outs.append(o)
        dqs.append(dq_t)
        dk[:, :, :e] += dk_t.float()
        dv[:, :, :e] += dv_t.float()
    return full, (torch.cat(outs, 2), torch.cat(dqs, 2), dk, dv)


SM90_CASES = {
    "documents-dropout": (1, 2, 1, 70, 200, 64, 130, True, 0, False, (90, 60, 1, 49), 0.0, 0.17),
    "window-gqa": (1, 4, 2, 45, 180, 64, 99, True, 40, False, None, 0.0, 0.0),
}


@interpreted
@pytest.mark.parametrize("name", list(SM90_CASES))
def test_triton_offset_with_the_sm90_tiles(name, use_backend, monkeypatch):
    """The block ranges at the sm_90 tiles (forward and dQ 128 x 64, dK/dV 128-key blocks), which the
    interpreter's 16 x 16 tiles never reach: offsets inside a block, documents crossing it."""
    from selective_ckpt.triton_kernels import attention as tk

    monkeypatch.setattr(tk, "INTERPRETED", False)  # config() then answers from the sm_90 table
    assert tk.config("fwd", 64, torch.bfloat16)[:2] == (128, 64)
    use_backend("triton")
    check_against_reference(SM90_CASES[name], torch.bfloat16)


# (B, H, Hkv, S, D, tile bounds, causal, window, padding, documents, softcap, dropout)
TILINGS = {
    "causal-dropout-gqa": (2, 4, 2, 77, 64, (0, 1, 30, 31, 64, 77), True, 0, False, None, 0.0, 0.17),
    "window-padded": (2, 2, 1, 61, 16, (0, 17, 40, 61), True, 9, True, None, 0.0, 0.17),
    "documents": (1, 2, 1, 90, 80, (0, 20, 21, 55, 90), True, 0, False, (15, 30, 2, 43), 0.0, 0.17),
    "documents-window-softcap": (1, 2, 2, 70, 16, (0, 33, 69, 70), True, 6, False, (40, 1, 29), 25.0, 0.0),
}


def _check_tiling(case, dtype, exact_output, device="cpu"):
    B, H, Hkv, S, D, bounds, causal, window, padding, docs, cap, p = case
    Q, K, V, grad = (t.to(device) for t in _inputs(B, H, Hkv, S, S, D, dtype, gen_seed=11))
    pad = _pad(B, S).to(device) if padding else None
    full, tiled = _tiled_and_untiled(Q, K, V, grad, bounds, causal, window, pad, docs, cap, p, seed=2**63 + 7)
    o_full, dq_full, dk_full, dv_full = full
    o_tiled, dq_tiled, dk_tiled, dv_tiled = tiled
    if exact_output:  # one row's keys are visited in the same blocks and order: the same bits
        assert torch.equal(o_tiled, o_full)
    else:
        torch.testing.assert_close(o_tiled, o_full, rtol=1e-6, atol=1e-6)
    # dQ of a row sums over key chunks that depend on Sk; dK/dV are sums over the tiles' rows.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dq_tiled, dq_full, **tol)
    torch.testing.assert_close(dk_tiled, dk_full.float(), **tol)
    torch.testing.assert_close(dv_tiled, dv_full.float(), **tol)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", list(TILINGS))
def test_cpp_tiles_concatenate_to_the_untiled_call(name, dtype, use_backend):
    use_backend("cpp")
    _check_tiling(TILINGS[name], dtype, exact_output=True)


# smaller for the interpreter, whose cost grows with the problem
TRITON_TILINGS = {
    "causal-dropout-gqa": (1, 4, 2, 37, 16, (0, 1, 17, 18, 32, 37), True, 0, False, None, 0.0, 0.17),
    "documents-window-padded": (1, 2, 1, 40, 16, (0, 9, 10, 33, 40), True, 5, True, None, 0.0, 0.17),
    "documents-softcap": (1, 2, 2, 43, 24, (0, 20, 42, 43), True, 0, False, (12, 14, 1, 16), 25.0, 0.17),
}


@interpreted
@pytest.mark.parametrize("name", list(TRITON_TILINGS))
def test_triton_tiles_concatenate_to_the_untiled_call(name, use_backend):
    use_backend("triton")
    _check_tiling(TRITON_TILINGS[name], torch.float32, exact_output=False)


@interpreted
@pytest.mark.parametrize("backend_name", ["cpp", "triton"])
def test_dropout_mask_is_the_contract_rows(backend_name, use_backend):
    """With v = identity, o is the dropped P of rows q_offset ...: its zeros are exactly rng's dropped
    entries of those global rows."""
    use_backend(backend_name)
    B, H, Sq, Sk, off, p, seed = 2, 2, 9, 24, 13, 0.4, 2**63 + 12345
    q, k, _, _ = _inputs(B, H, H, Sq, Sk, Sk, torch.float32)  # head dim Sk: v is the identity
    v = torch.eye(Sk).expand(B, H, Sk, Sk)
    o = selective_ckpt.attention(q, k, v, dropout_p=p, seed=seed, q_offset=off)
    keep = rng.attention_keep_mask(seed, B, H, off + Sq, Sk, p)[:, :, off:]
    assert torch.equal(o != 0, keep)
    expected = torch.softmax(q @ k.transpose(-1, -2) * Sk**-0.5, -1) * keep * rng.keep_scale(p)
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-6)


@interpreted
def test_backends_agree_with_an_offset(use_backend):
    case = (1, 2, 1, 21, 50, 16, 29, True, 11, False, (10, 30, 10), 0.0, 0.3)
    results = {}
    for name in ("cpp", "triton"):
        use_backend(name)
        results[name] = check_against_reference(case, torch.float32)
    for x, y in zip(results["cpp"], results["triton"]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)  # a differing mask would be O(1) off


def test_zero_offset_is_the_default_bit_for_bit(use_backend):
    use_backend("cpp")
    q, k, v, grad = _inputs(1, 2, 1, 33, 33, 16, torch.bfloat16)
    cu = torch.tensor([0, 10, 33], dtype=torch.int32)
    kw = dict(causal=True, dropout_p=0.2, seed=3, cu_seqlens=cu, sliding_window=7)
    a = _run(lambda x, y, z: selective_ckpt.attention(x, y, z, **kw), q, k, v, grad)
    b = _run(lambda x, y, z: selective_ckpt.attention(x, y, z, q_offset=0, **kw), q, k, v, grad)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_lse_has_the_query_rows(use_backend):
    use_backend("cpp")
    q, k, v, _ = _inputs(2, 4, 2, 5, 40, 16, torch.float32)
    o, lse = attention_ops.attention_fwd_op(q, k, v, None, None, True, 0, 0.0, 0.25, None, 0.0, 35)
    assert o.shape == (2, 5, 4, 16) and lse.shape == (2, 4, 5)
    ref = torch.logsumexp((q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25).masked_fill(
        ~attention_allowed(2, 5, 40, causal=True, q_offset=35), -math.inf), -1)
    torch.testing.assert_close(lse, ref, rtol=1e-5, atol=1e-5)


def test_opcheck_with_an_offset(use_backend):
    use_backend("cpp")
    q, k, v, _ = _inputs(1, 2, 1, 6, 13, 16, torch.float32)
    q.requires_grad_()
    seed = rng.seed_arg(2**64 - 5)
    cu = torch.tensor([0, 4, 13], dtype=torch.int32)
    torch.library.opcheck(attention_ops.attention_fwd_op, (q, k, v, None, cu, True, 3, 0.2, 0.25, seed, 0.0, 7))
    o, lse = attention_ops.attention_fwd_op(q.detach(), k, v, None, cu, True, 3, 0.2, 0.25, seed, 0.0, 7)
    o = attention_ops.heads_view(o)
    torch.library.opcheck(attention_ops.attention_bwd_op,
                          (torch.randn_like(o), q.detach(), k, v, o, lse, None, cu, True, 3, 0.2, 0.25, seed, 0.0, 7))


def test_query_tiles_trace_under_torch_compile(use_backend):
    """Tiles whose bounds come from the (dynamic) sequence length: q_offset arrives as a SymInt."""
    use_backend("cpp")
    torch._dynamo.reset()
    Q, K, V, grad = _inputs(1, 2, 1, 24, 24, 16, torch.float32)

    def tiles(q, k, v):
        s = q.shape[2] // 3
        return torch.cat([selective_ckpt.attention(q[:, :, a:e], k[:, :, :e], v[:, :, :e], causal=True, dropout_p=0.1,
                                                   seed=4, q_offset=a) for a, e in ((0, s), (s, q.shape[2]))], 2)

    compiled = torch.compile(tiles, fullgraph=True, dynamic=True)
    for x, y in zip(_run(tiles, Q, K, V, grad), _run(compiled, Q, K, V, grad)):
        assert torch.equal(x, y)


def _call(q_offset, Sq=5, Sk=9, **kw):
    q, k, v, _ = _inputs(1, 2, 1, Sq, Sk, 16, torch.float32)
    return selective_ckpt.attention(q, k, v, causal=True, q_offset=q_offset, **kw)


@pytest.mark.parametrize("bad", [-1, 5, 100, True, False, 1.0, 2.5, "3", None])
def test_bad_q_offset_is_rejected_naming_it(bad):
    with pytest.raises(ValueError, match="q_offset"):
        _call(bad)


def test_q_offset_error_names_the_sizes():
    with pytest.raises(ValueError, match=r"q_offset=5, Sq=5, Sk=9"):
        _call(5)


def test_largest_offset_and_documents_shorter_than_the_query_start():
    _call(4)  # q_offset + Sq == Sk
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    _call(3, cu_seqlens=cu)  # Sq + q_offset < Sk
    with pytest.raises(ValueError, match="end at S=9"):
        _call(3, cu_seqlens=torch.tensor([0, 2, 8], dtype=torch.int32))  # documents cover the keys, 0 ... Sk


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("D", [64, 128, 80])
def test_compiled_triton_offset(dtype, D):
    """The compiled kernels: tiles against the float64 reference and against the untiled call."""
    cases = {"causal-dropout": (2, 4, 2, 601, D, (0, 1, 128, 300, 301, 601), True, 0, False, None, 0.0, 0.17),
             "window-documents": (1, 4, 2, 601, D, (0, 200, 601), True, 100, False, (300, 211, 90), 0.0, 0.17),
             "padded": (2, 4, 4, 333, D, (0, 64, 333), False, 0, True, None, 0.0, 0.17)}
    for name, case in cases.items():
        B, H, Hkv, S, D, bounds, causal, window, padding, docs, cap, p = case
        _check_tiling(case, dtype, exact_output=False, device="cuda")
        s, e = bounds[-2], bounds[-1]
        tile = (B, H, Hkv, e - s, e, D, s, causal, window, padding, docs, cap, p)
        B, H, Hkv, Sq, Sk, D, off, causal, window, padding, docs, cap, p = tile
        q, k, v, grad = _inputs(B, H, Hkv, Sq, Sk, D, dtype)
        pad = _pad(B, Sk) if padding else None
        cu = None if docs is None else [min(c, e) for c in _cu(docs)]
        kw = dict(q_offset=off, causal=causal, window=window, pad=pad, cu=cu, cap=cap, p=p, seed=77)
        ours = _run(_ours(off, causal, window, None if pad is None else pad.cuda(), cu, cap, p, 77, "cuda"),
                    q.cuda(), k.cuda(), v.cuda(), grad.cuda())
        eager = _run(lambda a, b, c: eager_offset(a, b, c, **kw), q, k, v, grad)
        ref = _run(lambda a, b, c: eager_offset(a, b, c, **kw), q.double(), k.double(), v.double(), grad)
        for what, x, ev, r, factor in zip(("o", "dq", "dk", "dv"), ours, eager, ref, (2, 3, 3, 3)):
            assert_within_rule(x.cpu(), ev, r, factor, name=f"{name} {what}")
