"""Fused attention-softmax-dropout against eager PyTorch in float64 with the mask from rng."""

import math

import pytest
import torch

import selective_ckpt
from selective_ckpt import rng
from selective_ckpt.ops import attention as attention_ops
from tests.reference import assert_within_rule

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Triton on CPU tensors needs the interpreter, which conftest turns on only without a GPU; on a
# GPU the compiled kernels are checked by the cuda-marked tests instead.
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors runs interpreted only")


def eager_attention(q, k, v, causal=False, p=0.0, scale=None, mask=None, seed=0):
    """Plain attention in q's dtype: materialised softmax, the contract's dropout mask."""
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    allow = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    if causal:
        allow = allow & torch.ones(Sq, Sk, dtype=torch.bool).tril()
    if mask is not None:
        allow = allow & mask[:, None, None, :]
    anything = allow.any(-1, keepdim=True)
    # A row with nothing to attend gets 0 (and zero gradients) instead of softmax's NaN.
    s = torch.where(anything, s.masked_fill(~allow, -math.inf), 0.0)
    probs = torch.softmax(s, dim=-1) * anything
    if p > 0:
        keep = rng.attention_keep_mask(seed, B, H, Sq, Sk, p)
        probs = probs * keep * rng.keep_scale(p)
    return probs @ v


def make_inputs(B, H, Sq, Sk, D, dtype, packed=False, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    if packed:  # views of one qkv projection [B, S, 3, H, D], as the layer makes them
        assert Sq == Sk
        qkv = torch.randn(B, Sq, 3, H, D, generator=g).to(dtype)
        return [qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3)]
    return [torch.randn(B, H, S, D, generator=g).to(dtype) for S in (Sq, Sk, Sk)]


def make_mask(B, Sk, empty_batch=False, gen_seed=1):
    g = torch.Generator().manual_seed(gen_seed)
    mask = torch.rand(B, Sk, generator=g) > 0.3
    mask[:, 0] = True
    if empty_batch:
        mask[0] = False  # batch 0 attends nothing
    return mask


def run(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(grad.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


def check_against_eager(q, k, v, causal, p, mask, seed=1234, scale=None):
    kw = dict(causal=causal, dropout_p=p, softmax_scale=scale, key_padding_mask=mask, seed=seed)
    grad = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], generator=torch.Generator().manual_seed(7))
    ours = run(lambda a, b, c: selective_ckpt.attention(a, b, c, **kw), q, k, v, grad)
    ek = dict(causal=causal, p=p, scale=scale, mask=mask, seed=seed)
    eager = run(lambda a, b, c: eager_attention(a, b, c, **ek), q, k, v, grad)
    ref = run(lambda a, b, c: eager_attention(a, b, c, **ek), q.double(), k.double(), v.double(), grad)
    for name, x, e, r, factor in zip(("o", "dq", "dk", "dv"), ours, eager, ref, (2, 3, 3, 3)):
        assert_within_rule(x, e, r, factor, name=name)
    if q.dtype == torch.float32:
        for name, x, r in zip(("o", "dq", "dk", "dv"), ours, ref):
            assert (x.double() - r).abs().max() < 2e-5, name
    return ours


# (B, H, Sq, Sk, D, causal, p, padding, empty batch)
CPP_CASES = [
    (1, 1, 1, 1, 16, False, 0.0, False, False),
    (2, 2, 17, 77, 64, False, 0.17, True, False),
    (2, 3, 77, 17, 80, False, 0.0, True, True),
    (1, 2, 113, 203, 128, False, 0.17, False, False),
    (2, 2, 203, 113, 16, False, 0.17, True, False),
    (2, 2, 113, 113, 80, True, 0.17, True, False),
    (1, 3, 203, 203, 64, True, 0.0, False, False),
    (2, 1, 17, 17, 128, True, 0.0, True, True),
    (1, 2, 77, 203, 16, True, 0.17, False, False),
    (2, 4, 1, 77, 64, False, 0.17, True, False),
    (1, 2, 113, 77, 80, True, 0.17, True, False),
    (1, 2, 33, 17, 3, False, 0.17, True, False),
    (1, 1, 17, 33, 256, True, 0.17, False, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CPP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpp_matches_eager(case, dtype, use_backend):
    use_backend("cpp")
    B, H, Sq, Sk, D, causal, p, padding, empty = case
    q, k, v = make_inputs(B, H, Sq, Sk, D, dtype)
    mask = make_mask(B, Sk, empty) if padding else None
    check_against_eager(q, k, v, causal, p, mask)


TRITON_CASES = [
    (2, 2, 17, 33, 16, False, 0.17, True, True, torch.float32),
    (1, 2, 33, 33, 24, True, 0.17, False, False, torch.float32),
    (2, 1, 33, 9, 16, False, 0.17, True, False, torch.bfloat16),
    (1, 2, 20, 33, 24, True, 0.0, True, False, torch.float16),
    (2, 1, 33, 17, 16, True, 0.17, False, False, torch.float32),
    (1, 1, 1, 5, 16, False, 0.0, False, False, torch.bfloat16),
]


@interpreted
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_matches_eager(case, use_backend):
    use_backend("triton")
    B, H, Sq, Sk, D, causal, p, padding, empty, dtype = case
    q, k, v = make_inputs(B, H, Sq, Sk, D, dtype)
    mask = make_mask(B, Sk, empty) if padding else None
    check_against_eager(q, k, v, causal, p, mask, scale=0.3 if D == 24 else None)


@interpreted
@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_triton_unequal_blocks(blocks, use_backend, monkeypatch):
    """Causal block skipping and the dK/dV start row hold when query and key blocks differ."""
    from selective_ckpt.triton_kernels import attention as tk

    monkeypatch.setattr(tk, "INTERPRETER_BLOCKS", blocks)
    use_backend("triton")
    q, k, v = make_inputs(1, 1, 33, 40, 16, torch.float32)
    check_against_eager(q, k, v, True, 0.17, make_mask(1, 40))


@interpreted
def test_triton_and_cpp_agree(use_backend):
    q, k, v = make_inputs(2, 2, 33, 33, 16, torch.float32, packed=True)
    mask = make_mask(2, 33)
    grad = torch.randn(2, 2, 33, 16, generator=torch.Generator().manual_seed(3))
    fn = lambda a, b, c: selective_ckpt.attention(a, b, c, causal=True, dropout_p=0.3, key_padding_mask=mask, seed=99)
    results = {}
    for name in ("cpp", "triton"):
        use_backend(name)
        results[name] = run(fn, q, k, v, grad)
    for x, y in zip(results["cpp"], results["triton"]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)  # a differing mask would be O(1) off


@interpreted
@pytest.mark.parametrize("backend_name", ["cpp", "triton"])
def test_dropout_mask_is_the_contract(backend_name, use_backend):
    """With v = identity, o is the dropped P itself: its zeros are exactly rng's dropped entries."""
    use_backend(backend_name)
    B, H, S, p, seed = 2, 2, 16, 0.4, 2**63 + 12345
    q, k, _ = make_inputs(B, H, S, S, 16, torch.float32)
    v = torch.eye(S).expand(B, H, S, S)
    o = selective_ckpt.attention(q, k, v, dropout_p=p, seed=seed)
    keep = rng.attention_keep_mask(seed, B, H, S, S, p)
    assert torch.equal(o != 0, keep)
    expected = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) * keep * rng.keep_scale(p)
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-6)


@interpreted
def test_identical_calls_are_bit_identical_and_seed_none_follows_manual_seed(backend):
    q, k, v = make_inputs(1, 2, 33, 17, 16, torch.float32)
    grad = torch.randn(1, 2, 33, 16, generator=torch.Generator().manual_seed(5))
    calls = []
    for _ in range(2):
        torch.manual_seed(42)
        calls.append(run(lambda a, b, c: selective_ckpt.attention(a, b, c, dropout_p=0.2), q, k, v, grad))
    for x, y in zip(*calls):
        assert torch.equal(x, y)
    other = run(lambda a, b, c: selective_ckpt.attention(a, b, c, dropout_p=0.2), q, k, v, grad)  # a fresh seed
    assert not torch.equal(other[0], calls[0][0])


@interpreted
@pytest.mark.parametrize("backend_name", ["cpp", "triton"])
def test_rows_with_nothing_to_attend_are_zero(backend_name, use_backend):
    use_backend(backend_name)
    q, k, v = make_inputs(2, 1, 5, 9, 16, torch.bfloat16)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1] = False
    o, dq, dk, dv = run(lambda a, b, c: selective_ckpt.attention(a, b, c, key_padding_mask=mask, dropout_p=0.1),
                        q, k, v, torch.ones(2, 1, 5, 16))
    for t in (o, dq, dk, dv):
        assert torch.isfinite(t).all()
        assert (t[1] == 0).all()
    assert (o[0] != 0).any()


def test_saves_only_qkv_o_lse_and_seed(use_backend):
    use_backend("cpp")
    B, H, S, D = 1, 2, 64, 16  # S*S > B*H*S*D: a score-sized tensor would stand out
    qkv = torch.randn(B, S, 3, H, D, requires_grad=True)
    q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o = selective_ckpt.attention(q, k, v, causal=True, dropout_p=0.1, seed=5)
    assert all(t.numel() < S * S for t in saved), [tuple(t.shape) for t in saved]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    assert qkv.untyped_storage().data_ptr() in storages  # q, k, v saved as views, no copies
    assert o.untyped_storage().data_ptr() in storages  # the very buffer that was returned
    lse = [t for t in saved if t.dtype == torch.float32 and t.shape == (B, H, S)]
    assert len(lse) == 1
    seeds = [t for t in saved if t.dtype == torch.int32]
    assert len(seeds) == 1 and rng.seed_from_tensor(seeds[0]) == 5  # the dropout state: 8 bytes
    assert sum(storages.values()) == (3 + 1) * B * S * H * D * 4 + B * H * S * 4 + 8
    # o is a [B, H, S, D] view of [B, S, H, D]: the layer's reshape for proj needs no copy.
    flat = o.transpose(1, 2).reshape(B, S, H * D)
    assert flat.data_ptr() == o.data_ptr() and o.transpose(1, 2).is_contiguous()
    o.sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


def _allocated_by(step):
    """Net bytes `step` leaves allocated on the CPU, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def test_forward_leaves_only_o_and_lse_alive(use_backend):
    use_backend("cpp")
    B, H, S, D = 1, 4, 256, 16
    qkv = torch.randn(B, S, 3, H, D, requires_grad=True)
    q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    out = {}
    alive = _allocated_by(lambda: out.setdefault("o", selective_ckpt.attention(q, k, v, dropout_p=0.1, seed=4)))
    expected = B * S * H * D * 4 + B * H * S * 4  # o and lse; one score matrix would be 1 MiB
    assert expected <= alive <= expected + 4096, alive
    out["o"].sum().backward()


def test_packed_views_match_contiguous(use_backend):
    use_backend("cpp")
    q, k, v = make_inputs(2, 3, 17, 17, 80, torch.bfloat16, packed=True)
    assert not q.is_contiguous()
    grad = torch.randn(2, 3, 17, 80)
    fn = lambda a, b, c: selective_ckpt.attention(a, b, c, causal=True, dropout_p=0.17, seed=8)
    for x, y in zip(run(fn, q, k, v, grad), run(fn, q.contiguous(), k.contiguous(), v.contiguous(), grad)):
        assert torch.equal(x, y)


@pytest.mark.cuda
def test_forward_leaves_nothing_score_sized_alive_on_cuda():
    B, H, S, D = 1, 4, 2048, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o = selective_ckpt.attention(q, k, v, causal=True, dropout_p=0.1)
    torch.cuda.synchronize()
    alive = torch.cuda.memory_allocated() - before
    assert alive <= o.numel() * 2 + B * H * S * 4 + 4096, alive  # o and lse; S*S*H*2 bytes would be 32 MiB
    o.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [16, 64, 80, 128, 256])
def test_compiled_triton_matches_eager(dtype, D):
    for causal, p, padding in ((False, 0.17, True), (True, 0.0, False), (True, 0.17, True)):
        q, k, v = (t.cuda() for t in make_inputs(2, 3, 203, 203 if causal else 113, D, dtype))
        mask = make_mask(2, k.shape[2]).cuda() if padding else None
        _check_cuda(q, k, v, causal, p, mask)


@pytest.mark.cuda
def test_cuda_masks_and_determinism():
    B, H, S, p, seed = 2, 3, 64, 0.4, 2**63 + 99
    q, k = (t.cuda() for t in make_inputs(B, H, S, S, 64, torch.float32)[:2])
    v = torch.eye(S, device="cuda").expand(B, H, S, S)
    o = selective_ckpt.attention(q, k, v, dropout_p=p, seed=seed)
    assert torch.equal((o != 0).cpu(), rng.attention_keep_mask(seed, B, H, S, S, p))
    q, k, v = (t.cuda() for t in make_inputs(2, 4, 203, 203, 128, torch.bfloat16))
    grad = torch.randn(2, 4, 203, 128, device="cuda")
    fn = lambda a, b, c: selective_ckpt.attention(a, b, c, causal=True, dropout_p=0.1, seed=3)
    for x, y in zip(run(fn, q, k, v, grad), run(fn, q, k, v, grad)):
        assert torch.equal(x, y)  # no atomics: identical calls give identical bits


def _check_cuda(q, k, v, causal, p, mask, seed=77):
    kw = dict(causal=causal, dropout_p=p, key_padding_mask=mask, seed=seed)
    grad = torch.randn(q.shape, device="cuda")
    ours = run(lambda a, b, c: selective_ckpt.attention(a, b, c, **kw), q, k, v, grad)
    cpu = [t.cpu() for t in (q, k, v)]
    ek = dict(causal=causal, p=p, mask=None if mask is None else mask.cpu(), seed=seed)
    eager = run(lambda a, b, c: eager_attention(a, b, c, **ek), *cpu, grad.cpu())
    ref = run(lambda a, b, c: eager_attention(a, b, c, **ek), *(t.double() for t in cpu), grad.cpu())
    for name, x, e, r, factor in zip(("o", "dq", "dk", "dv"), ours, eager, ref, (2, 3, 3, 3)):
        assert_within_rule(x.cpu(), e, r, factor, name=name)


def test_opcheck_both_ops(use_backend):
    use_backend("cpp")
    q, k, v = make_inputs(2, 2, 9, 13, 16, torch.float32)
    mask = make_mask(2, 13)
    q.requires_grad_()
    seed = rng.seed_arg(2**64 - 5)
    torch.library.opcheck(attention_ops.attention_fwd_op, (q, k, v, mask, None, True, 0, 0.2, 0.25, seed))
    o, lse = attention_ops.attention_fwd_op(q, k, v, None, None, False, 0, 0.0, 0.25, None)
    o = attention_ops.heads_view(o)  # the op returns the [B, Sq, H, D] buffer
    do = torch.randn_like(o)
    torch.library.opcheck(attention_ops.attention_bwd_op,
                          (do, q.detach(), k, v, o.detach(), lse.detach(), mask, None, False, 0, 0.2, 0.25, seed))


def test_cpu_op_traces_under_torch_compile(use_backend):
    use_backend("cpp")
    torch._dynamo.reset()
    q, k, v = make_inputs(1, 2, 17, 17, 16, torch.float32)
    mask = make_mask(1, 17)
    fn = lambda a, b, c: selective_ckpt.attention(a, b, c, causal=True, dropout_p=0.17, key_padding_mask=mask, seed=11)
    grad = torch.randn(1, 2, 17, 16)
    compiled = torch.compile(fn, fullgraph=True)
    for x, y in zip(run(fn, q, k, v, grad), run(compiled, q, k, v, grad)):
        assert torch.equal(x, y)


def _bad(**changes):
    q, k, v = make_inputs(2, 2, 5, 7, 16, torch.float32)
    args = dict(q=q, k=k, v=v)
    args.update(changes)
    return args


BAD_INPUTS = [
    (dict(q=torch.randn(2, 5, 16)), ValueError, "q must have rank 4"),
    (dict(k=torch.randn(3, 2, 7, 16)), ValueError, "k must have shape"),
    (dict(k=torch.randn(2, 3, 7, 16), v=torch.randn(2, 3, 7, 16)), ValueError, "number of heads Hkv that divides"),
    (dict(v=torch.randn(2, 2, 9, 16)), ValueError, "v must have shape \\[B, Hkv, Sk, Dv\\] with k.s"),
    (dict(v=torch.randn(2, 2, 7, 300)), ValueError, "value head dim Dv"),
    (dict(v=torch.randn(2, 2, 7, 16, dtype=torch.float16)), TypeError, "share one dtype"),
    (dict(q=torch.randn(2, 2, 5, 16, dtype=torch.float64)), TypeError, "q must be float32"),
    (dict(q=torch.ones(2, 2, 5, 16, dtype=torch.int32)), TypeError, "q must be float32"),
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.randn(1, 1, 2, 300), k=torch.randn(1, 1, 2, 300), v=torch.randn(1, 1, 2, 300)), ValueError,
     "head dim D"),
    (dict(q=torch.randn(1, 1, 2, 0), k=torch.randn(1, 1, 2, 0), v=torch.randn(1, 1, 2, 0)), ValueError, "head dim D"),
    (dict(k=torch.randn(2, 2, 16, 7).transpose(-1, -2)), ValueError, "k must have a contiguous last dim"),
    (dict(dropout_p=1.0), ValueError, "dropout_p must be in"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p must be in"),
    (dict(key_padding_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, "key_padding_mask must have shape"),
    (dict(key_padding_mask=torch.ones(2, 7)), TypeError, "key_padding_mask must be a bool"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(softmax_scale="x"), TypeError, "softmax_scale"),
    (dict(seed=-1), ValueError, "seed must be in"),
    (dict(sliding_window=0), ValueError, "sliding_window must be a positive int"),
    (dict(sliding_window=2.5), ValueError, "sliding_window must be a positive int"),
    (dict(cu_seqlens=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "B = 1"),
    (dict(q=torch.randn(1, 2, 7, 16), k=torch.randn(1, 2, 7, 16), v=torch.randn(1, 2, 7, 16),
          cu_seqlens=torch.tensor([0.0, 7.0])), ValueError, "cu_seqlens must be an int32"),
    (dict(q=torch.randn(1, 2, 7, 16), k=torch.randn(1, 2, 7, 16), v=torch.randn(1, 2, 7, 16),
          cu_seqlens=torch.tensor([[0, 7]], dtype=torch.int32)), ValueError, "cu_seqlens must be 1-D"),
    (dict(q=torch.randn(1, 2, 7, 16), k=torch.randn(1, 2, 7, 16), v=torch.randn(1, 2, 7, 16),
          cu_seqlens=torch.tensor([1, 7], dtype=torch.int32)), ValueError, "start at 0 and end at S=7"),
    (dict(q=torch.randn(1, 2, 7, 16), k=torch.randn(1, 2, 7, 16), v=torch.randn(1, 2, 7, 16),
          cu_seqlens=torch.tensor([0, 6], dtype=torch.int64)), ValueError, "start at 0 and end at S=7"),
    (dict(q=torch.randn(1, 2, 7, 16), k=torch.randn(1, 2, 7, 16), v=torch.randn(1, 2, 7, 16),
          cu_seqlens=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(q=torch.randn(1, 2, 5, 16), k=torch.randn(1, 2, 7, 16), v=torch.randn(1, 2, 7, 16),
          cu_seqlens=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "one length"),
    (dict(q=torch.randn(1, 2, 7, 16), k=torch.randn(1, 2, 7, 16), v=torch.randn(1, 2, 7, 16),
          key_padding_mask=torch.ones(1, 7, dtype=torch.bool), cu_seqlens=torch.tensor([0, 7], dtype=torch.int32)),
     ValueError, "cannot be combined"),
]


@pytest.mark.parametrize("changes,error,message", BAD_INPUTS, ids=lambda x: str(x)[:40] if isinstance(x, str) else None)
def test_bad_input_is_rejected_naming_the_argument(changes, error, message):
    with pytest.raises(error, match=message):
        selective_ckpt.attention(**_bad(**changes))


def test_device_mismatch_is_rejected():
    q, k, v = make_inputs(1, 1, 3, 3, 16, torch.float32)
    with pytest.raises(ValueError, match="one device"):
        selective_ckpt.attention(q, k.to("meta"), v)
