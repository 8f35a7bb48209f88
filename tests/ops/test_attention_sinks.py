"""attention(..., sinks=s): gpt-oss's attention sinks, a learned logit s_h per query head in every row's
softmax denominator that carries no value.

Judged against float64 eager attention written here the way transformers' gpt_oss eager attention
computes it (the sink as an extra logit column, softmax, the column dropped), with the masks of
tests/reference.py and the contract's dropout mask, under the project's rule (2x outputs / 3x gradients
the error of the same eager code in the same dtype); gradients of q, k, v and the sinks. On the C++
kernels (every ISA this CPU runs for bf16, both backward schedules, small tiles for ragged edges) and
on the Triton kernels interpreted.
"""

import math

import pytest
import torch

import selective_ckpt
from selective_ckpt import _C, rng
from selective_ckpt.ops import attention as attention_ops
from tests.reference import assert_within_rule, attention_allowed, max_err

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors runs interpreted only")

RATIOS = {}  # (case, dtype, what) -> (our error, eager's error) against float64, for the record


def eager_sinks(q, k, v, sinks, q_offset=0, causal=False, window=0, pad=None, cu=None, cap=0.0, p=0.0, seed=0):
    """Materialised attention in q's dtype with the sink as one more logit column (transformers'
    gpt_oss eager attention: concatenated, softmax, dropped), masks as -inf, query row i at key position
    i + q_offset, the contract's dropout mask of those rows."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    if cap:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~attention_allowed(B, Sq, Sk, causal, window, pad, cu, q_offset=q_offset), -math.inf)
    logits = torch.cat([s, sinks.to(s.dtype).view(1, H, 1, 1).expand(B, H, Sq, 1)], -1)
    probs = torch.softmax(logits, -1)[..., :-1]
    if p > 0:
        keep = rng.attention_keep_mask(seed, B, H, q_offset + Sq, Sk, p)[:, :, q_offset:]
        probs = probs * keep * rng.keep_scale(p)
    return probs @ v


def _inputs(B, H, Hkv, Sq, Sk, D, dtype, sink_dtype):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    sinks = (torch.randn(H, generator=g) * 2).to(sink_dtype)  # some above the rows' max logit, some far below
    return q, k, v, sinks, torch.randn(B, H, Sq, D, generator=g)


def _run(fn, q, k, v, sinks, grad):
    q, k, v, sinks = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    o = fn(q, k, v, sinks)
    o.backward(grad.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad, sinks.grad


def _ours(q_offset=0, causal=False, window=0, pad=None, cu=None, cap=0.0, p=0.0, seed=0, device="cpu"):
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    pad = None if pad is None else pad.to(device)
    return lambda a, b, c, s: selective_ckpt.attention(a, b, c, causal=causal, dropout_p=p, key_padding_mask=pad,
                                                       seed=seed, sliding_window=window or None, cu_seqlens=cu_t,
                                                       softcap=cap or None, q_offset=q_offset, sinks=s)


# (B, H, Hkv, Sq, Sk, D, q_offset, causal, window, padding, documents, softcap, dropout)
CASES = {
    "one-key": (2, 2, 1, 1, 1, 16, 0, True, 0, False, None, 0.0, 0.0),
    "one-row-last": (2, 2, 1, 1, 17, 32, 16, True, 0, False, None, 0.0, 0.17),
    "s17-causal-gqa": (2, 4, 2, 17, 17, 64, 0, True, 0, False, None, 0.0, 0.0),
    "s70-window-padded-dropout": (2, 2, 2, 70, 70, 128, 0, True, 9, True, None, 0.0, 0.17),
    "documents-softcap-dropout": (1, 4, 2, 70, 70, 40, 0, True, 0, False, (13, 40, 17), 20.0, 0.17),
    "offset-window-dropout": (1, 2, 1, 17, 70, 80, 53, True, 11, False, None, 0.0, 0.17),
    "cross-not-causal-padded": (2, 2, 2, 17, 70, 24, 0, False, 0, True, None, 0.0, 0.0),
}


def check(name, dtype, case=None, sink_dtype=None, seed=77, device="cpu"):
    """Ours against the float64 reference under the rule (gradients of q, k, v and sinks); fp32 also within
    2e-5 absolute. The sinks are in q's dtype unless sink_dtype says otherwise (eager takes them in q's).
    `device`: where ours runs (eager and the reference run on the CPU)."""
    B, H, Hkv, Sq, Sk, D, off, causal, window, padding, docs, cap, p = case or CASES[name]
    q, k, v, sinks, grad = _inputs(B, H, Hkv, Sq, Sk, D, dtype, sink_dtype or dtype)
    pad = None
    if padding:
        pad = torch.rand(B, Sk, generator=torch.Generator().manual_seed(5)) > 0.3
        pad[:, 0] = True
    cu = None if docs is None else [0, *torch.tensor(docs).cumsum(0).tolist()]
    kw = dict(q_offset=off, causal=causal, window=window, pad=pad, cu=cu, cap=cap, p=p, seed=seed)
    ours = _run(_ours(**kw, device=device), *(t.to(device) for t in (q, k, v, sinks, grad)))
    ours = tuple(t.cpu() for t in ours)
    eager = _run(lambda a, b, c, s: eager_sinks(a, b, c, s.to(dtype), **kw), q, k, v, sinks, grad)
    ref = _run(lambda a, b, c, s: eager_sinks(a, b, c, s, **kw), q.double(), k.double(), v.double(), sinks.double(),
               grad)
    assert ours[4].dtype == sinks.dtype  # the gradient lands in the sinks' own dtype
    for what, x, e, r, factor in zip(("o", "dq", "dk", "dv", "dsinks"), ours, eager, ref, (2, 3, 3, 3, 3)):
        assert_within_rule(x, e.to(x.dtype), r, factor, name=f"{name} {dtype} {what}")
        RATIOS[(name, str(dtype), what)] = (max_err(x, r), max_err(e.to(x.dtype), r))
    if dtype == torch.float32:
        for what, x, r in zip(("o", "dq", "dk", "dv", "dsinks"), ours, ref):
            assert (x.double() - r).abs().max() < 2e-5 * max(1.0, r.abs().max().item()), what
    return ours, ref


@pytest.fixture
def small_tiles():
    """16 x 16 tiles: a 70-row problem then has ragged edges on both sides and many tiles per row."""
    old = _C.attention_tiles(16, 16)
    yield
    _C.attention_tiles(*old)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", [name for name in CASES if name != "one-key"])
def test_cpp_sinks_against_float64(name, dtype, use_backend):
    use_backend("cpp")
    check(name, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("name", [name for name in CASES if name != "one-key"])
def test_compiled_triton_sinks_against_float64(name, dtype):
    """The compiled Triton kernels on a GPU (sinks always run ours: no fused kernel of PyTorch's takes them)."""
    check(name, dtype, device="cuda")


def test_cpp_sinks_one_key(use_backend):
    """S = 1 against one key: fp32 under the rule. In 16 bits the rows' delta comes from O rounded to the
    input dtype (docs/kernels/attention_cpu.md, known behaviours): with one key P = 1 / (1 + e^(s - x)) and
    dS = P (1 - P) dP, whose error from that rounding grows as 1 / (1 - P); the sinks' gradient does not
    take delta alone and stays within the rule."""
    use_backend("cpp")
    check("one-key", torch.float32)
    q, k, v, sinks, grad = _inputs(2, 2, 1, 1, 1, 16, torch.bfloat16, torch.bfloat16)
    ours = _run(_ours(causal=True), q, k, v, sinks, grad)
    eager = _run(lambda a, b, c, s: eager_sinks(a, b, c, s, causal=True), q, k, v, sinks, grad)
    ref = _run(lambda a, b, c, s: eager_sinks(a, b, c, s, causal=True), q.double(), k.double(), v.double(),
               sinks.double(), grad)
    assert_within_rule(ours[0], eager[0], ref[0], 2, name="one-key bf16 o")
    assert_within_rule(ours[4], eager[4], ref[4], 3, name="one-key bf16 dsinks")


@pytest.mark.parametrize("passes", [1, 2], ids=["single-pass", "two-pass"])
@pytest.mark.parametrize("name", ["s70-window-padded-dropout", "documents-softcap-dropout"])
def test_cpp_sinks_small_tiles_both_schedules(name, passes, small_tiles, use_backend):
    use_backend("cpp")
    old = _C.attention_backward_passes(passes)
    try:
        check(name, torch.bfloat16)
        check(name, torch.float32)
    finally:
        _C.attention_backward_passes(old)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512bf16emu", "avx512bf16"])
def test_cpp_sinks_every_isa(isa, use_backend):
    use_backend("cpp")
    try:
        old = _C.attention_use_isa(isa)
    except ValueError:
        pytest.skip(f"this CPU does not run {isa}")
    try:
        check("s17-causal-gqa", torch.bfloat16)
        check("offset-window-dropout", torch.float32)
    finally:
        _C.attention_use_isa(old)


def test_cpp_sinks_fp16_and_fp32_sinks_on_bf16(use_backend):
    use_backend("cpp")
    check("documents-softcap-dropout", torch.float16)
    check("s17-causal-gqa", torch.bfloat16, sink_dtype=torch.float32)


@pytest.mark.parametrize("backend_name", ["cpp", "triton"])
def test_rows_attending_nothing_give_zero(backend_name, use_backend):
    """Padding that hides every key a causal row may see: the sink takes all the mass; the row's output and
    its share of every gradient are 0 (the float64 reference gives exactly that)."""
    if backend_name == "triton" and torch.cuda.is_available():
        pytest.skip("Triton on CPU tensors runs interpreted only")
    use_backend(backend_name)
    B, H, S, D = 2, 2, 21, 16
    q, k, v, sinks, grad = _inputs(B, H, H, S, S, D, torch.float32, torch.float32)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :6] = False  # rows 0..5 of batch 0 see no key
    ours = _run(_ours(causal=True, pad=pad), q, k, v, sinks, grad)
    ref = _run(lambda a, b, c, s: eager_sinks(a, b, c, s, causal=True, pad=pad), q.double(), k.double(), v.double(),
               sinks.double(), grad)
    assert torch.equal(ours[0][0, :, :6], torch.zeros(H, 6, D))
    assert torch.equal(ours[1][0, :, :6], torch.zeros(H, 6, D))
    assert torch.equal(ref[0][0, :, :6], torch.zeros(H, 6, D, dtype=torch.float64))
    for what, x, r in zip(("o", "dq", "dk", "dv", "dsinks"), ours, ref):
        assert (x.double() - r).abs().max() < 2e-5, what


@pytest.mark.parametrize("backend_name", ["cpp", "triton"])
def test_extreme_sinks_neither_overflow_nor_vanish(backend_name, use_backend):
    """A sink 80 above every logit (the rows' mass all but gone) and one 80 below (no effect), in fp32:
    the denominator is measured from max(m, s_h), so nothing overflows."""
    if backend_name == "triton" and torch.cuda.is_available():
        pytest.skip("Triton on CPU tensors runs interpreted only")
    use_backend(backend_name)
    q, k, v, _, grad = _inputs(1, 2, 1, 19, 19, 16, torch.float32, torch.float32)
    sinks = torch.tensor([80.0, -80.0])
    ours = _run(_ours(causal=True), q, k, v, sinks, grad)
    ref = _run(lambda a, b, c, s: eager_sinks(a, b, c, s, causal=True), q.double(), k.double(), v.double(),
               sinks.double(), grad)
    for what, x, r in zip(("o", "dq", "dk", "dv", "dsinks"), ours, ref):
        assert torch.isfinite(x).all(), what
        assert (x.double() - r).abs().max() < 2e-5, what
    plain = selective_ckpt.attention(q, k, v, causal=True)
    assert ours[0][0, 0].abs().max() < 1e-20  # head 0: the sink takes everything
    torch.testing.assert_close(ours[0][0, 1], plain[0, 1], rtol=0, atol=1e-6)


def test_minus_inf_sinks_are_no_sinks_bit_for_bit(use_backend):
    """exp(-inf) adds exactly 0 to the denominator: the output equals the call without sinks bit for bit
    on the C++ kernels, and the sinks' gradient is 0."""
    use_backend("cpp")
    q, k, v, _, grad = _inputs(2, 4, 2, 37, 37, 24, torch.bfloat16, torch.float32)
    kw = dict(causal=True, dropout_p=0.2, seed=5, sliding_window=11)
    ours = _run(lambda a, b, c, s: selective_ckpt.attention(a, b, c, sinks=s, **kw), q, k, v,
                torch.full((4,), -math.inf), grad)
    plain = _run(lambda a, b, c, s: selective_ckpt.attention(a, b, c, **kw) + 0 * s.sum(), q, k, v,
                 torch.zeros(4), grad)
    for x, y in zip(ours[:4], plain[:4]):
        assert torch.equal(x, y)
    assert torch.equal(ours[4], torch.zeros(4))


def test_sinks_change_the_result(use_backend):
    use_backend("cpp")
    q, k, v, sinks, _ = _inputs(1, 2, 2, 13, 13, 16, torch.float32, torch.float32)
    assert (selective_ckpt.attention(q, k, v, causal=True, sinks=sinks)
            - selective_ckpt.attention(q, k, v, causal=True)).abs().max() > 1e-2


def test_gradient_reaches_a_parameter(use_backend):
    """A bf16 nn.Parameter of sinks gets its gradient (summed in fp32 over batch and rows, then rounded once)."""
    use_backend("cpp")
    q, k, v, _, grad = _inputs(3, 2, 1, 40, 40, 16, torch.bfloat16, torch.bfloat16)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=torch.bfloat16))
    selective_ckpt.attention(q, k, v, causal=True, sinks=sinks).backward(grad.bfloat16())
    ref = _run(lambda a, b, c, s: eager_sinks(a, b, c, s, causal=True), q.double(), k.double(), v.double(),
               sinks.detach().double(), grad.bfloat16())[4]  # the same upstream gradient: ours within rounding
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16
    torch.testing.assert_close(sinks.grad.double(), ref, rtol=2**-8, atol=1e-6)


def test_sinks_need_no_grad(use_backend):
    use_backend("cpp")
    q, k, v, sinks, grad = _inputs(1, 2, 2, 9, 9, 16, torch.float32, torch.float32)
    q.requires_grad_()
    selective_ckpt.attention(q, k, v, sinks=sinks).backward(grad)
    assert q.grad is not None and sinks.grad is None


@pytest.mark.parametrize("bad, error, match", [
    ([0.0, 1.0], TypeError, "sinks must be a torch.Tensor"),
    (torch.zeros(2, dtype=torch.int32), TypeError, "sinks must be a floating-point"),
    (torch.zeros(3), ValueError, r"sinks must have shape \[H=2\]"),
    (torch.zeros(1, 2), ValueError, r"sinks must have shape \[H=2\]"),
    (torch.zeros(2, device="meta"), ValueError, "sinks must be on q's device"),
])
def test_bad_sinks(bad, error, match):
    q, k, v, _, _ = _inputs(1, 2, 1, 4, 4, 8, torch.float32, torch.float32)
    with pytest.raises(error, match=match):
        selective_ckpt.attention(q, k, v, sinks=bad)


def test_opcheck_with_sinks(use_backend):
    use_backend("cpp")
    q, k, v, sinks, _ = _inputs(1, 2, 1, 6, 13, 16, torch.float32, torch.float32)
    q.requires_grad_()
    sinks.requires_grad_()
    seed = rng.seed_arg(2**64 - 5)
    cu = torch.tensor([0, 4, 13], dtype=torch.int32)
    args = (q, k, v, None, cu, True, 3, 0.2, 0.25, seed, 0.0, 7, sinks)
    torch.library.opcheck(attention_ops.attention_fwd_op, args)
    o, lse = attention_ops.attention_fwd_op(q.detach(), k, v, None, cu, True, 3, 0.2, 0.25, seed, 0.0, 7,
                                            sinks.detach())
    o = attention_ops.heads_view(o)
    torch.library.opcheck(attention_ops.attention_bwd_op, (torch.randn_like(o), q.detach(), k, v, o, lse, None, cu,
                                                           True, 3, 0.2, 0.25, seed, 0.0, 7, sinks.detach()))


def test_sinks_trace_under_torch_compile(use_backend):
    use_backend("cpp")
    torch._dynamo.reset()
    q, k, v, sinks, grad = _inputs(1, 2, 1, 17, 17, 16, torch.float32, torch.float32)
    fn = _ours(causal=True, p=0.17, seed=11)
    compiled = torch.compile(fn, fullgraph=True)
    for x, y in zip(_run(fn, q, k, v, sinks, grad), _run(compiled, q, k, v, sinks, grad)):
        assert torch.equal(x, y)


TRITON_CASES = {
    "one-row": (1, 2, 1, 1, 17, 16, 16, True, 0, False, None, 0.0, 0.0),
    "s17-gqa-padded-dropout": (2, 4, 2, 17, 17, 16, 0, True, 0, True, None, 0.0, 0.17),
    "window-documents-softcap": (1, 2, 1, 37, 37, 24, 0, True, 7, False, (10, 20, 7), 20.0, 0.0),
    "offset-not-causal-dropout": (1, 2, 2, 17, 45, 32, 20, False, 0, False, None, 0.0, 0.17),
}


@interpreted
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_sinks_against_float64(name, dtype, use_backend):
    use_backend("triton")
    check(name, dtype, case=TRITON_CASES[name])


@interpreted
def test_backends_agree_with_sinks(use_backend):
    results = {}
    for name in ("cpp", "triton"):
        use_backend(name)
        results[name] = check("offset", torch.float32, case=(1, 2, 1, 21, 50, 16, 29, True, 11, False,
                                                             (10, 30, 10), 0.0, 0.3))[0]
    for x, y in zip(results["cpp"], results["triton"]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@interpreted
def test_triton_sinks_with_the_sm90_tiles(use_backend, monkeypatch):
    """The tiles a GPU launch takes (forward and dQ 128 x 64: the dQ kernel's dS row sums over several key
    blocks, ragged last blocks), interpreted."""
    from selective_ckpt.triton_kernels import attention as tk

    monkeypatch.setattr(tk, "INTERPRETED", False)  # config() then answers from the sm_90 table
    assert tk.config("dq", 64, torch.bfloat16)[:2] == (128, 64)
    use_backend("triton")
    check("sm90-d64", torch.bfloat16, case=(1, 4, 2, 150, 150, 64, 0, True, 100, False, None, 0.0, 0.1))
