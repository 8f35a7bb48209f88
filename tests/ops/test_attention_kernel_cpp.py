"""The blocked C++ attention kernels (_C.attention_forward / attention_backward), called directly.

Judged against float64 eager attention built here (masks, GQA by repeating k/v in the reference
only, the dropout mask from rng), with the project's rule: our error at most 2x (outputs) / 3x
(gradients) the error of SDPA in the same dtype, plus a floor.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from selective_ckpt import backend, rng
from tests.reference import assert_within_rule, attention_allowed

_C = backend._C
CODES = backend.DTYPE_CODES
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture
def tiles():
    """tiles(bq, bk) sets the kernel's tile sizes for one test."""
    old = []

    def set_tiles(bq, bk):
        old.append(_C.attention_tiles(bq, bk))

    yield set_tiles
    if old:
        _C.attention_tiles(*old[0])


@pytest.fixture(params=[1, 2], ids=["single-pass", "two-pass"])
def backward_passes(request):
    """Forces the backward's single pass (dQ, dK, dV from each score tile formed once) or its two
    passes for one test, whatever the shape would choose."""
    old = _C.attention_backward_passes(request.param)
    yield request.param
    _C.attention_backward_passes(old)


def _args(q, k, v, mask, cu, causal, window, scale, p, seed, softcap=0.0):
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    seed_t = rng.seed_arg(seed) if p > 0 else None
    mask_u8 = None if mask is None else mask.contiguous().view(torch.uint8)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    keep = (seed_t, mask_u8, cu_t)  # alive until the call returns
    common = dict(key_padding_mask=0 if mask_u8 is None else mask_u8.data_ptr(),
                  cu_seqlens=0 if cu_t is None else cu_t.data_ptr(), n_docs=0 if cu is None else len(cu) - 1,
                  causal=causal, window=window or 0, scale=scale, softcap=softcap,
                  seed=0 if seed_t is None else seed_t.data_ptr(), t16=rng.threshold(p), keep_scale=rng.keep_scale(p))
    return (B, H, Hkv, Sq, Sk, D, v.shape[3]), common, keep


def kernel_forward(q, k, v, mask=None, cu=None, causal=False, window=0, scale=None, p=0.0, seed=0, softcap=0.0):
    B, H, Sq, D = q.shape
    sizes, common, _keep = _args(q, k, v, mask, cu, causal, window, scale, p, seed, softcap)
    o = torch.full((B, Sq, H, v.shape[3]), 7.0, dtype=q.dtype).permute(0, 2, 1, 3)  # the op's layout; 7 = unwritten
    lse = torch.full((B, H, Sq), 7.0)
    _C.attention_forward(CODES[q.dtype], sizes, q.data_ptr(), q.stride()[:3], k.data_ptr(), k.stride()[:3],
                         v.data_ptr(), v.stride()[:3], o.data_ptr(), o.stride()[:3], lse.data_ptr(), **common)
    return o, lse


def kernel_backward(do, q, k, v, o, lse, mask=None, cu=None, causal=False, window=0, scale=None, p=0.0, seed=0,
                    softcap=0.0):
    sizes, common, _keep = _args(q, k, v, mask, cu, causal, window, scale, p, seed, softcap)
    do = do.contiguous()
    dq, dk, dv = (torch.full(t.shape, 7.0, dtype=t.dtype) for t in (q, k, v))
    _C.attention_backward(CODES[q.dtype], sizes, do.data_ptr(), q.data_ptr(), q.stride()[:3], k.data_ptr(),
                          k.stride()[:3], v.data_ptr(), v.stride()[:3], o.data_ptr(), o.stride()[:3],
                          lse.contiguous().data_ptr(), dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr(), **common)
    return dq, dk, dv


def reference(q, k, v, allow, scale, p=0.0, seed=0):
    """Eager attention in q's dtype with a materialised softmax (rows attending nothing give 0)."""
    B, H, Sq, D = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    anything = allow.any(-1, keepdim=True)
    s = torch.where(anything, s.masked_fill(~allow, -math.inf), 0.0)
    probs = torch.softmax(s, dim=-1) * anything
    if p > 0:
        probs = probs * rng.attention_keep_mask(seed, B, H, Sq, k.shape[2], p) * rng.keep_scale(p)
    return probs @ v


def sdpa(q, k, v, allow, scale):
    """torch SDPA in q's dtype with the same mask; rows attending nothing set to 0 as ours."""
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allow, scale=scale, enable_gqa=True)
    return torch.where(allow.any(-1, keepdim=True), o, 0.0)


def with_grads(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(grad.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


def make(B, H, Hkv, Sq, Sk, D, dtype, seed=0, packed=False, Dv=None):
    """q, k of head dim D and v of head dim Dv (D unless given: MLA's value head is narrower)."""
    g = torch.Generator().manual_seed(seed)
    if Dv is not None and Dv != D:
        return (torch.randn(B, H, Sq, D, generator=g).to(dtype), torch.randn(B, Hkv, Sk, D, generator=g).to(dtype),
                torch.randn(B, Hkv, Sk, Dv, generator=g).to(dtype))
    if packed:  # views of one [B, S, H + 2 Hkv, D] projection, as the layer makes them
        qkv = torch.randn(B, Sq, H + 2 * Hkv, D, generator=g).to(dtype).transpose(1, 2)
        return qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
    return (torch.randn(B, H, Sq, D, generator=g).to(dtype), torch.randn(B, Hkv, Sk, D, generator=g).to(dtype),
            torch.randn(B, Hkv, Sk, D, generator=g).to(dtype))


def check(B, H, Hkv, Sq, Sk, D, dtype, causal=False, window=0, pad=False, empty=False, cu=None, p=0.0,
          scale=None, packed=False, seed=1234, Dv=None):
    q, k, v = make(B, H, Hkv, Sq, Sk, D, dtype, packed=packed, Dv=Dv)
    mask = None
    if pad:
        mask = torch.rand(B, Sk, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[:, 0] = True
        if empty:
            mask[0] = False  # batch 0 attends nothing
    allow = attention_allowed(B, Sq, Sk, causal, window, mask, cu)
    sc = D**-0.5 if scale is None else scale
    grad = torch.randn(B, H, Sq, v.shape[3], generator=torch.Generator().manual_seed(7))
    kw = dict(mask=mask, cu=cu, causal=causal, window=window, scale=scale, p=p, seed=seed)

    o, lse = kernel_forward(q, k, v, **kw)
    dq, dk, dv = kernel_backward(grad.to(dtype), q, k, v, o, lse, **kw)
    ref = with_grads(lambda a, b, c: reference(a, b, c, allow, sc, p, seed), q.double(), k.double(), v.double(), grad)
    if p > 0:  # SDPA cannot take our mask: plain eager in the same dtype is the comparison
        same = with_grads(lambda a, b, c: reference(a, b, c, allow, sc, p, seed), q, k, v, grad)
    else:
        same = with_grads(lambda a, b, c: sdpa(a, b, c, allow, sc), q, k, v, grad)
    for name, x, e, r, factor in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), same, ref, (2, 3, 3, 3)):
        assert_within_rule(x, e, r, factor, name=name)
        if dtype == torch.float32:
            assert (x.double() - r).abs().max() < 2e-5, name
    # lse: natural-log logsumexp of the scaled, masked scores; +inf where a row attends nothing
    s = (q.double() @ k.double().repeat_interleave(H // Hkv, 1).transpose(-1, -2)) * sc
    lse_ref = torch.logsumexp(s.masked_fill(~allow, -math.inf), -1)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin].double(), lse_ref[fin], rtol=1e-4, atol=1e-4)
    return o, lse, dq, dk, dv


# (B, H, Hkv, Sq, Sk, D, causal, window, padding, empty batch, dropout)
CASES = [
    (1, 1, 1, 1, 1, 16, False, 0, False, False, 0.0),
    (2, 2, 1, 17, 77, 64, False, 0, True, False, 0.17),
    (2, 4, 2, 77, 17, 80, False, 5, True, True, 0.0),
    (1, 2, 2, 113, 203, 128, False, 0, False, False, 0.17),
    (2, 2, 2, 203, 113, 16, False, 1, True, False, 0.0),
    (2, 4, 2, 113, 113, 80, True, 0, True, False, 0.17),
    (1, 4, 1, 203, 203, 64, True, 5, False, False, 0.0),
    (2, 2, 1, 17, 17, 128, True, 0, True, True, 0.0),
    (1, 2, 2, 77, 203, 16, True, 300, False, False, 0.17),
    (2, 4, 4, 1, 77, 64, False, 0, True, False, 0.17),
    # window 1: P is one-hot, so the exact dQ is 0; eager gets exactly 0 from its own rounded dP, a
    # kernel taking delta = rowsum(dO * O) from the stored 16-bit O does not under dropout (o is
    # keep_scale * v rounded). Without dropout O = v exactly and delta matches dP bit for bit.
    (1, 2, 1, 113, 77, 80, True, 1, True, False, 0.0),
    (1, 2, 1, 113, 77, 80, True, 3, False, False, 0.17),
    (1, 2, 2, 33, 17, 3, False, 0, True, False, 0.17),
    (1, 2, 1, 17, 33, 256, True, 0, False, False, 0.17),
    (1, 2, 2, 77, 77, 256, False, 17, False, False, 0.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference(case, dtype, backward_passes):
    B, H, Hkv, Sq, Sk, D, causal, window, pad, empty, p = case
    check(B, H, Hkv, Sq, Sk, D, dtype, causal, window, pad, empty, p=p)


# cu_seqlens: ragged documents, lengths including 1
PACKED = [
    ([0, 1, 18, 95, 96, 203], False, 0, 0.0),
    ([0, 1, 18, 95, 96, 203], True, 0, 0.17),
    ([0, 40, 41, 113], True, 5, 0.0),
    ([0, 77], False, 3, 0.17),
    ([0, 16, 32, 48, 64, 65], True, 0, 0.0),
]


# v's head dim Dv != D (multi-head latent attention: q, k of 192 = 128 + 64 rotary, v of 128), odd both ways:
# (B, H, Hkv, Sq, Sk, D, Dv, causal, window, padding, dropout)
VALUE_DIMS = [
    (1, 2, 1, 77, 77, 48, 32, True, 0, True, 0.17),
    (2, 4, 2, 45, 113, 24, 40, False, 5, True, 0.0),
    (1, 2, 2, 113, 113, 67, 3, True, 0, False, 0.17),
    (1, 2, 1, 17, 33, 5, 131, False, 0, False, 0.0),
    (1, 3, 3, 96, 96, 192, 128, True, 0, False, 0.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", VALUE_DIMS, ids=lambda c: "-".join(map(str, c)))
def test_value_head_dim(case, dtype, backward_passes):
    B, H, Hkv, Sq, Sk, D, Dv, causal, window, pad, p = case
    o, _, dq, dk, dv = check(B, H, Hkv, Sq, Sk, D, dtype, causal, window, pad, p=p, Dv=Dv)
    assert o.shape[-1] == Dv and dq.shape[-1] == D and dk.shape[-1] == D and dv.shape[-1] == Dv


@pytest.mark.parametrize("bq,bk", [(16, 16), (48, 16)])
def test_value_head_dim_tiles_and_documents(bq, bk, tiles, backward_passes):
    """Dv != D at ragged tile edges and with packed documents."""
    tiles(bq, bk)
    check(1, 4, 2, 113, 113, 80, torch.float32, True, 0, p=0.17, Dv=48, cu=[0, 1, 18, 95, 96, 113])
    check(1, 4, 2, 113, 113, 40, torch.bfloat16, True, 5, p=0.0, Dv=72, cu=[0, 40, 41, 113])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PACKED, ids=lambda c: "-".join(map(str, c)))
def test_packed_documents(case, dtype, backward_passes):
    cu, causal, window, p = case
    S = cu[-1]
    check(1, 4, 2, S, S, 64, dtype, causal, window, cu=cu, p=p, packed=True)


@pytest.mark.parametrize("bq,bk", [(16, 16), (16, 48), (48, 16), (128, 256)])
def test_tile_sizes(bq, bk, tiles, backward_passes):
    """Block skipping and tile edges hold for unequal and small tiles."""
    tiles(bq, bk)
    check(2, 4, 2, 113, 113, 80, torch.float32, True, 0, True, False, p=0.17)
    check(1, 2, 1, 77, 203, 64, torch.bfloat16, False, 9, True, False, p=0.0)
    check(1, 4, 2, 203, 203, 16, torch.float32, True, 5, cu=[0, 1, 18, 95, 96, 203], p=0.17)


def test_window_and_custom_scale_fp16():
    check(2, 2, 2, 113, 113, 64, torch.float16, True, 1, scale=0.3)
    check(1, 2, 1, 77, 77, 64, torch.float16, False, 200, scale=0.05)


def test_identical_calls_are_bit_identical(backward_passes):
    q, k, v = make(2, 4, 2, 113, 113, 64, torch.bfloat16, packed=True)
    grad = torch.randn(2, 4, 113, 64).to(torch.bfloat16)
    kw = dict(causal=True, p=0.17, seed=99)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (threads, 1, threads):  # the thread count never changes the order of a sum
            torch.set_num_threads(n)
            o, lse = kernel_forward(q, k, v, **kw)
            results.append((o, lse, *kernel_backward(grad, q, k, v, o, lse, **kw)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x, y)


def test_dropout_mask_is_the_contract():
    """With v = identity, o is the dropped P itself: its zeros are exactly rng's dropped entries."""
    B, H, S, p, seed = 2, 2, 40, 0.4, 2**63 + 12345
    q, k, _ = make(B, H, H, S, S, S, torch.float32)  # v's head dim is S: q and k share it
    v = torch.eye(S).expand(B, H, S, S)
    o, _ = kernel_forward(q, k, v, p=p, seed=seed, scale=0.25)
    keep = rng.attention_keep_mask(seed, B, H, S, S, p)
    assert torch.equal(o != 0, keep)
    expected = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) * keep * rng.keep_scale(p)
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-6)


def test_rows_with_nothing_to_attend():
    q, k, v = make(2, 2, 1, 9, 13, 16, torch.bfloat16)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1] = False
    o, lse = kernel_forward(q, k, v, mask=mask, p=0.1, seed=3)
    dq, dk, dv = kernel_backward(torch.ones(2, 2, 9, 16, dtype=torch.bfloat16), q, k, v, o, lse, mask=mask, p=0.1,
                                 seed=3)
    assert torch.isinf(lse[1]).all() and (lse[1] > 0).all() and torch.isfinite(lse[0]).all()
    for t in (o, dq, dk, dv):
        assert torch.isfinite(t).all() and (t[1] == 0).all()
    assert (o[0] != 0).any()


def test_fp16_large_logits_stay_finite():
    """q = k = 20 at D = 256: q.k = 102400 overflows fp16, the scaled logit 6400 does not."""
    q = torch.full((1, 1, 4, 256), 20.0, dtype=torch.float16)
    k = q.clone()
    v = torch.randn(1, 1, 4, 256).half()
    o, lse = kernel_forward(q, k, v, causal=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    dq, dk, dv = kernel_backward(torch.randn(1, 1, 4, 256).half(), q, k, v, o, lse, causal=True)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    g = torch.Generator().manual_seed(3)
    q, k, v = ((torch.randn(2, 2, 77, 64, generator=g) * 100).half() for _ in range(3))
    o, lse = kernel_forward(q, k, v)
    dq, dk, dv = kernel_backward(torch.randn(2, 2, 77, 64).half(), q, k, v, o, lse)
    assert all(torch.isfinite(t).all() for t in (o, lse, dq, dk, dv))
    ref = reference(q.double(), k.double(), v.double(), attention_allowed(2, 77, 77), 64**-0.5)
    assert (o.double() - ref).abs().max() < 0.05 * ref.abs().max()


def test_nan_key_and_query_propagate_like_sdpa():
    q, k, v = make(1, 2, 2, 17, 17, 16, torch.float32)
    k[0, 0, 5] = math.nan
    o, lse = kernel_forward(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attends = torch.arange(17) >= 5
    # Every row that attends the NaN key is NaN, in ours and in SDPA; other heads are untouched.
    assert torch.isnan(o[0, 0, attends]).all() and torch.isnan(ref[0, 0, attends]).all()
    assert torch.isfinite(o[0, 0, ~attends]).all() and torch.isfinite(o[0, 1]).all()
    assert torch.equal(torch.isnan(o[0, 0]).any(-1), torch.isnan(ref[0, 0]).any(-1))
    dq, dk, dv = kernel_backward(torch.ones_like(o), q, k, v, o, lse, causal=True)
    assert torch.isnan(dq[0, 0, attends]).all() and torch.isfinite(dq[0, 1]).all()

    q, k, v = make(1, 2, 2, 17, 17, 16, torch.float32)
    q[0, 1, 3] = math.nan
    o, lse = kernel_forward(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(torch.isnan(o), torch.isnan(ref))
    assert torch.isnan(o[0, 1, 3]).all() and torch.isnan(o).sum() == 16


def test_inf_key_gives_nan_like_sdpa():
    q, k, v = make(1, 1, 1, 9, 9, 16, torch.float32)
    k[0, 0, 2] = math.inf  # scores of +-inf: softmax has inf - inf
    o, _ = kernel_forward(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(torch.isnan(o), torch.isnan(ref))


def test_float64_inputs():
    q, k, v = make(1, 2, 1, 33, 45, 24, torch.float64)
    allow = attention_allowed(1, 33, 45, causal=True, window=7)
    o, lse = kernel_forward(q, k, v, causal=True, window=7, p=0.17, seed=5)
    grad = torch.randn(1, 2, 33, 24, dtype=torch.float64)
    ref = with_grads(lambda a, b, c: reference(a, b, c, allow, 24**-0.5, 0.17, 5), q, k, v, grad)
    ours = (o, *kernel_backward(grad, q, k, v, o, lse, causal=True, window=7, p=0.17, seed=5))
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-12)
    for x, r in zip(ours[1:], ref[1:]):  # backward rebuilds P from the fp32 lse
        torch.testing.assert_close(x, r, rtol=1e-6, atol=1e-6)


# The public function runs these kernels on CPU: same bits as the direct calls above.
PUBLIC = [
    dict(B=2, H=4, Hkv=2, S=77, causal=True, window=5, p=0.17, pad=True),
    dict(B=1, H=4, Hkv=1, S=113, causal=False, window=0, p=0.0, pad=False),
    dict(B=1, H=4, Hkv=2, S=96, causal=True, window=9, p=0.17, pad=False, cu=[0, 1, 40, 40, 96]),
]


@pytest.mark.parametrize("case", PUBLIC, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_public_attention_is_the_kernel(case):
    import selective_ckpt

    B, H, Hkv, S, D = case["B"], case["H"], case["Hkv"], case["S"], 64
    q, k, v = make(B, H, Hkv, S, S, D, torch.bfloat16, packed=True)
    mask = None
    if case["pad"]:
        mask = torch.rand(B, S, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[:, 0] = True
    cu = case.get("cu")
    grad = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    public = with_grads(lambda a, b, c: selective_ckpt.attention(
        a, b, c, causal=case["causal"], dropout_p=case["p"], key_padding_mask=mask, seed=21,
        sliding_window=case["window"] or None, cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32)),
        q, k, v, grad)
    kw = dict(mask=mask, cu=cu, causal=case["causal"], window=case["window"], p=case["p"], seed=21)
    o, lse = kernel_forward(q, k, v, **kw)
    direct = (o, *kernel_backward(grad, q, k, v, o, lse, **kw))
    for x, y in zip(public, direct):
        assert torch.equal(x, y)
    allow = attention_allowed(B, S, S, case["causal"], case["window"], mask, cu)
    ref = with_grads(lambda a, b, c: reference(a, b, c, allow, D**-0.5, case["p"], 21), q.double(), k.double(),
                     v.double(), grad)
    same = with_grads(lambda a, b, c: reference(a, b, c, allow, D**-0.5, case["p"], 21), q, k, v, grad)
    for name, x, e, r, factor in zip(("o", "dq", "dk", "dv"), public, same, ref, (2, 3, 3, 3)):
        assert_within_rule(x, e, r, factor, name=name)


# every variant csrc/attention.cpp compiles; a test skips the ones this CPU cannot run
ISAS = ["generic", "avx2", "avx512", "avx512bf16emu", "avx512bf16"]


@pytest.mark.parametrize("isa", ISAS)
def test_every_compiled_isa(isa, backward_passes):
    """The kernels are compiled per ISA (4- and 8-row register blocks, bf16 tiles in native dot
    products under avx512bf16); each one meets the rule, odd head dims and tile edges included."""
    try:
        old = _C.attention_use_isa(isa)
    except ValueError:
        pytest.skip(f"this CPU does not run {isa}")
    try:
        assert _C.attention_isa() == isa
        check(2, 4, 2, 113, 113, 80, torch.bfloat16, True, 0, True, False, p=0.17)
        check(1, 2, 1, 77, 45, 3, torch.float32, False, 9, True, True, p=0.0)
        check(1, 2, 1, 77, 45, 3, torch.bfloat16, False, 9, True, True, p=0.0)
        check(2, 2, 1, 45, 77, 40, torch.bfloat16, False, 0, False, False, p=0.17)
        check(1, 4, 2, 96, 96, 64, torch.float16, True, 5, cu=[0, 1, 40, 40, 96], p=0.17)
        check(1, 2, 1, 77, 77, 48, torch.bfloat16, True, 0, True, False, p=0.17, Dv=35)  # v's own head dim
    finally:
        _C.attention_use_isa(old)


@pytest.mark.parametrize("isa", ISAS)
def test_dropout_masks_are_the_contract_on_every_isa(isa):
    """The keep bits each pass draws (16 or 8 Philox calls side by side per ISA), read off exactly:
    with q = k = 0 and v = I, o is the kept P; with dO = I, dV[j, i] != 0 iff P[i, j] is kept."""
    import selective_ckpt

    try:
        old = _C.attention_use_isa(isa)
    except ValueError:
        pytest.skip(f"this CPU does not run {isa}")
    try:
        for B, H, Sq, Sk, causal, seed in ((2, 3, 37, 150, False, 2**64 - 5), (1, 2, 130, 77, False, 7),
                                           (1, 1, 200, 200, True, 0x1234_5678_9ABC)):
            D, p = max(Sq, Sk), 0.3
            want = rng.attention_keep_mask(seed, B, H, Sq, Sk, p)
            if causal:
                want &= torch.ones(Sq, Sk, dtype=torch.bool).tril()
            q = torch.zeros(B, H, Sq, D, requires_grad=True)
            k = torch.zeros(B, H, Sk, D, requires_grad=True)
            v = torch.eye(Sk, D).expand(B, H, Sk, D).contiguous().requires_grad_()
            o = selective_ckpt.attention(q, k, v, dropout_p=p, seed=seed, causal=causal)
            assert torch.equal(o[..., :Sk] != 0, want), (B, H, Sq, Sk, causal)
            o.backward(torch.eye(Sq, D).expand(B, H, Sq, D))
            assert torch.equal(v.grad[..., :Sq].transpose(-1, -2) != 0, want), (B, H, Sq, Sk, causal)
    finally:
        _C.attention_use_isa(old)
