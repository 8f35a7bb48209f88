"""The Triton attention entry points (the attention kernel contract), called directly: on CPU
tensors under the interpreter and, marked `cuda`, compiled on a GPU. Against float64 eager
attention built here: causal, sliding window, key padding, per-document (cu_seqlens) masks, GQA,
dropout from rng.attention_keep_mask, strided (packed) q/k/v and dq/dk/dv; judged by
tests/reference.py's rule against plain PyTorch in the same dtype. Tiny shapes, since the
interpreter is slow: with 16 x 16 tiles, and once with the sm_90 tile table a GPU launch uses. On
a GPU also: a grid with B*H > 65535 and a CUDA graph of a whole SelectiveDecoderLayer training
step with dropout (the kernels read seeds from device memory: no host sync)."""

import math

import pytest
import torch

from selective_ckpt import rng
from tests.reference import assert_within_rule, attention_allowed

# Triton on CPU tensors runs interpreted, which conftest turns on only without a GPU; with one, the
# cuda-marked tests at the end run the compiled kernels on the same cases.
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors runs interpreted only")


def _tk():
    from selective_ckpt.triton_kernels import attention

    return attention


def _seed_tensor(seed):
    from selective_ckpt.triton_kernels.philox import seed_tensor

    return seed_tensor(seed, "cpu")


def eager(q, k, v, causal=False, window=0, pad=None, cu=None, p=0.0, seed=0, scale=None):
    """Materialised attention in q's dtype; GQA by repeating k, v (the reference only)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scale = D**-0.5 if scale is None else scale
    ok = attention_allowed(B, Sq, Sk, causal, window, pad, cu)
    anything = ok.any(-1, keepdim=True)
    s = torch.where(anything, ((q @ k.transpose(-1, -2)) * scale).masked_fill(~ok, -math.inf), 0.0)
    probs = torch.softmax(s, -1) * anything  # a row with nothing to attend gives 0
    if p > 0:
        probs = probs * rng.attention_keep_mask(seed, B, H, Sq, Sk, p) * rng.keep_scale(p)
    return probs @ v


def ours_fwd_bwd(q, k, v, grad, causal, window, pad, cu, p, seed, scale, packed_grads=False):
    tk = _tk()
    B, H, Sq, D = q.shape
    o = torch.empty(B, Sq, H, D, dtype=q.dtype).permute(0, 2, 1, 3)  # as the op layer allocates it
    lse = torch.empty(B, H, Sq, dtype=torch.float32)
    t16, ks = rng.threshold(p), rng.keep_scale(p)
    sd = _seed_tensor(seed) if p > 0 else None
    tk.forward(q, k, v, o, lse, pad, cu, causal, window, scale, 0.0, sd, t16, ks)
    if packed_grads:
        buf = torch.full((B, Sq, 3, H, D), float("nan"), dtype=q.dtype)
        dq, dk, dv = (buf[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    else:
        dq, dk, dv = (torch.full(t.shape, float("nan"), dtype=t.dtype) for t in (q, k, v))
    tk.backward(grad.to(q.dtype).contiguous(), q, k, v, o, lse, pad, cu, causal, window, scale, 0.0, sd, t16, ks,
                dq, dk, dv)
    return o, lse, dq, dk, dv


def inputs(B, H, Hkv, Sq, Sk, D, dtype, packed=False, gen=0):
    g = torch.Generator().manual_seed(gen)
    if packed:
        qkv = torch.randn(B, Sq, 3, H, D, generator=g).to(dtype)
        return [qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3)]
    return [torch.randn(B, h, S, D, generator=g).to(dtype) for h, S in ((H, Sq), (Hkv, Sk), (Hkv, Sk))]


def grads_of(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(grad.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


# (B, H, Hkv, Sq, Sk, D, dtype, causal, window, padding, docs, p, packed)
CASES = {
    "fp32-ragged": (2, 2, 2, 33, 33, 16, torch.float32, False, 0, False, None, 0.0, False),
    "fp32-causal-pad-drop": (2, 2, 2, 33, 40, 16, torch.float32, True, 0, True, None, 0.17, False),
    "bf16-causal-window-drop-d24": (1, 2, 2, 37, 37, 24, torch.bfloat16, True, 5, False, None, 0.17, False),
    "fp16-gqa-causal-drop-even": (1, 4, 2, 32, 32, 16, torch.float16, True, 0, False, None, 0.1, False),
    "bf16-varlen-gqa-causal-window-drop": (1, 4, 2, 45, 45, 16, torch.bfloat16, True, 6, False, (7, 13, 25), 0.17,
                                           False),
    "fp32-varlen": (1, 2, 1, 40, 40, 16, torch.float32, False, 0, False, (1, 16, 17, 6), 0.0, False),
    "fp16-packed": (2, 2, 2, 19, 19, 16, torch.float16, False, 0, False, None, 0.0, True),
    "fp32-window-not-causal-sq-ne-sk": (1, 2, 2, 21, 35, 16, torch.float32, False, 4, False, None, 0.17, False),
    "bf16-mqa-drop-empty-row": (2, 3, 1, 17, 23, 16, torch.bfloat16, False, 0, True, None, 0.3, False),
    "fp16-d64-causal": (1, 1, 1, 18, 18, 64, torch.float16, True, 0, False, None, 0.1, False),
    # whole blocks, no mask but dropout: the dK/dV loop's split form with empty edge ranges
    "bf16-even-drop-not-causal": (2, 2, 2, 32, 48, 16, torch.bfloat16, False, 0, False, None, 0.2, False),
}


@interpreted
@pytest.mark.parametrize("name", list(CASES))
def test_triton_attention_against_float64(name):
    check_against_float64(name, *CASES[name])


# The sm_90 tile table (the tiles a GPU launch gets, e.g. 128 x 64 forward blocks, 64 x 128 dK/dV
# blocks, the split dK/dV loop with empty edges), run by the interpreter on shapes a few blocks long.
TABLE_CASES = {
    "bf16-d64-causal-drop-lean": (1, 2, 2, 192, 192, 64, torch.bfloat16, True, 0, False, None, 0.2, False),
    "bf16-d128-drop-lean-packed": (1, 2, 2, 128, 128, 128, torch.bfloat16, False, 0, False, None, 0.2, True),
    "fp16-d64-gqa-window-drop-ragged": (1, 4, 2, 200, 200, 64, torch.float16, True, 70, False, None, 0.1, False),
    "bf16-d80-pad-drop-sq-ne-sk": (2, 1, 1, 96, 136, 80, torch.bfloat16, False, 0, True, None, 0.1, False),
    "bf16-d256-gqa-causal-drop-ragged": (1, 4, 2, 70, 70, 256, torch.bfloat16, True, 0, False, None, 0.1, False),
}


@interpreted
@pytest.mark.parametrize("name", list(TABLE_CASES))
def test_sm90_tile_table_against_float64(name, monkeypatch):
    monkeypatch.setattr(_tk(), "INTERPRETED", False)  # config() then answers from the sm_90 table
    assert _tk().config("fwd", 64, torch.bfloat16)[:2] == (128, 64)
    check_against_float64(name, *TABLE_CASES[name])


def check_against_float64(name, B, H, Hkv, Sq, Sk, D, dtype, causal, window, padding, docs, p, packed):
    q, k, v = inputs(B, H, Hkv, Sq, Sk, D, dtype, packed)
    pad = None
    if padding:
        pad = torch.rand(B, Sk, generator=torch.Generator().manual_seed(5)) > 0.3
        pad[:, 0] = True
        pad[0] = False  # batch 0 attends nothing: o = 0, zero gradients
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32) if docs else None
    seed, scale = 0xDEAD_BEEF_1234_5678, D**-0.5
    grad = torch.randn(B, H, Sq, D, generator=torch.Generator().manual_seed(7))
    kw = dict(causal=causal, window=window, pad=pad, cu=cu, p=p, seed=seed, scale=scale)

    o, lse, dq, dk, dv = ours_fwd_bwd(q, k, v, grad, causal, window, pad, cu, p, seed, scale, packed_grads=packed)
    plain = grads_of(lambda a, b, c: eager(a, b, c, **kw), q, k, v, grad)
    ref = grads_of(lambda a, b, c: eager(a, b, c, **kw), q.double(), k.double(), v.double(), grad.double())
    for nm, x, e, r, factor in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), plain, ref, (2, 3, 3, 3)):
        assert_within_rule(x, e, r, factor, name=nm)
    if dtype == torch.float32:
        for nm, x, r in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), ref):
            assert (x.double() - r).abs().max() < 2e-5, nm

    # lse: natural log of the scaled, masked scores' exp-sum; +inf where nothing is attended
    ok = attention_allowed(B, Sq, Sk, causal, window, pad, cu)
    s = (q.double() @ k.double().repeat_interleave(H // Hkv, 1).transpose(-1, -2)) * scale
    want = torch.logsumexp(s.masked_fill(~ok, -math.inf), -1)
    want = torch.where(ok.any(-1), want, math.inf)
    assert torch.equal(torch.isinf(lse), torch.isinf(want))
    fin = torch.isfinite(want)
    assert (lse.double()[fin] - want[fin]).abs().max() < 1e-4 if fin.any() else True

    again = ours_fwd_bwd(q, k, v, grad, causal, window, pad, cu, p, seed, scale, packed_grads=packed)
    for a, b in zip((o, lse, dq, dk, dv), again):
        assert torch.equal(a, b), "repeat is not bit-identical"


@interpreted
def test_dropout_tile_expansion_is_the_contract_mask():
    """The kernels' dropout tiles: key-permuted columns (forward, dQ: key_order, Philox values spread
    in registers) and key-permuted rows (dK/dV: key_order_t, keep bits packed per Philox call)."""
    from selective_ckpt.triton_kernels import philox

    seed, p = 0x0123_4567_89AB_CDEF, 0.3
    shape = (1, 2, 21, 37)
    want = rng.attention_keep_mask(seed, *shape, p)
    for bm, bn, trans in ((16, 16, False), (8, 8, False), (16, 32, False), (32, 16, False), (4, 64, False),
                          (16, 16, True), (8, 32, True), (16, 128, True), (4, 64, True)):
        out = torch.full(shape, -1, dtype=torch.int8)
        philox.attention_mask(_seed_tensor(seed), rng.threshold(p), out, bm, bn, trans=trans)
        assert torch.equal(out.bool(), want) and (out >= 0).all(), (bm, bn, trans)


@interpreted
def test_no_dropout_never_reads_the_seed():
    """Dropout off: the seed argument is None and the kernels run (nothing to read)."""
    q, k, v = inputs(1, 1, 1, 16, 16, 16, torch.float32)
    grad = torch.randn(1, 1, 16, 16)
    o, *_ = ours_fwd_bwd(q, k, v, grad, True, 0, None, None, 0.0, 0, 0.25)
    ref = eager(q.double(), k.double(), v.double(), causal=True, scale=0.25)
    assert (o.double() - ref).abs().max() < 2e-5


@interpreted
def test_nan_key_propagates_like_sdpa():
    q, k, v = inputs(1, 1, 1, 16, 16, 16, torch.float32)
    k[0, 0, 3, 0] = float("nan")
    tk = _tk()
    o = torch.empty_like(q)
    lse = torch.empty(1, 1, 16)
    tk.forward(q, k, v, o, lse, None, None, True, 0, 0.25, 0.0, None, 0, 1.0)
    assert torch.isfinite(o[0, 0, :3]).all() and torch.isnan(o[0, 0, 3:]).all(1).all()


# ---- compiled kernels on a GPU (run by bench/gpu.sh) ----

def _run_case(name, device="cuda"):
    from selective_ckpt.triton_kernels import attention as tk
    from selective_ckpt.triton_kernels.philox import seed_tensor

    B, H, Hkv, Sq, Sk, D, dtype, causal, window, padding, docs, p, packed = CASES[name]
    q, k, v = (x.to(device) for x in inputs(B, H, Hkv, Sq, Sk, D, dtype, packed))
    pad = None
    if padding:
        pad = torch.rand(B, Sk, generator=torch.Generator().manual_seed(5)) > 0.3
        pad[:, 0] = True
        pad[0] = False
        pad = pad.to(device)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32) if docs else None
    seed, scale = 0xDEAD_BEEF_1234_5678, D**-0.5
    grad = torch.randn(B, H, Sq, D, generator=torch.Generator().manual_seed(7))
    o = torch.empty(B, Sq, H, D, dtype=dtype, device=device).permute(0, 2, 1, 3)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=device)
    t16, ks = rng.threshold(p), rng.keep_scale(p)
    sd = seed_tensor(seed, device) if p > 0 else None
    cud = cu.to(device) if cu is not None else None
    tk.forward(q, k, v, o, lse, pad, cud, causal, window, scale, 0.0, sd, t16, ks)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    tk.backward(grad.to(device, dtype).contiguous(), q, k, v, o, lse, pad, cud, causal, window, scale, 0.0, sd, t16, ks,
                dq, dk, dv)
    kw = dict(causal=causal, window=window, pad=pad.cpu() if pad is not None else None, cu=cu, p=p, seed=seed,
              scale=scale)
    cpu = [x.cpu() for x in (q, k, v)]
    plain = grads_of(lambda a, b, c: eager(a.float(), b.float(), c.float(), **kw).to(dtype), *cpu, grad)
    ref = grads_of(lambda a, b, c: eager(a, b, c, **kw), *(x.double() for x in cpu), grad.double())
    for nm, x, e, r, factor in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), plain, ref, (2, 3, 3, 3)):
        # fp32 eager on the CPU is the comparator for 16-bit too: the GPU kernels accumulate in fp32
        assert_within_rule(x.cpu(), e.to(x.dtype), r, factor, floor=1e-2 if dtype != torch.float32 else 1e-4,
                           name=nm)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["fp32-causal-pad-drop", "bf16-causal-window-drop-d24", "fp16-gqa-causal-drop-even",
                                  "bf16-varlen-gqa-causal-window-drop", "fp16-packed", "bf16-mqa-drop-empty-row"])
def test_compiled_kernels_against_float64(name):
    _run_case(name)


@pytest.mark.cuda
def test_more_than_65535_batch_heads():
    from selective_ckpt.triton_kernels import attention as tk

    B, H, S, D = 2, 33000, 16, 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(B, H, S, device="cuda")
    tk.forward(q, k, v, o, lse, None, None, True, 0, D**-0.5, 0.0, None, 0, 1.0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (o.float() - want.float()).abs().max() < 1e-2


@pytest.mark.cuda
def test_cuda_graph_replays_a_training_step_with_dropout():
    import selective_ckpt

    torch.manual_seed(0)
    layer = selective_ckpt.SelectiveDecoderLayer(256, 4, dropout=0.1, attn_dropout=0.1, device="cuda",
                                                 dtype=torch.bfloat16)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)

    def step():
        y = layer(x)
        y.backward(gy)
        # detached: a returned y would keep its graph, and with it the AccumulateGrad nodes of the stream it ran
        # on, alive into later steps (torch warns of the stream mismatch when the captured graph's are reused)
        return y.detach()

    named = [*layer.named_parameters(), ("x", x)]

    def grads():
        missing = [n for n, p in named if p.grad is None]
        assert not missing, f"no gradient after the step for {missing}"
        return [p.grad for _, p in named]

    def clear():
        for _, p in named:
            p.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile kernels, settle the allocator
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = step()
    # the graph's own gradient buffers: each replay overwrites them (captured with p.grad None: assigned, not
    # accumulated), and p.grad = ... is not replayed, so they are read directly, whatever p.grad holds later
    static = grads()

    for s in (1, 2):
        torch.manual_seed(s)
        graph.replay()
        torch.cuda.synchronize()
        got_y, got = y_graph.clone(), [g.clone() for g in static]
        clear()
        torch.manual_seed(s)
        want_y = step()
        want = grads()
        assert torch.equal(got_y, want_y), f"seed {s}: output differs"
        for (n, _), a, b in zip(named, got, want):
            assert torch.equal(a, b), f"seed {s}: the gradient of {n} differs"
        clear()
