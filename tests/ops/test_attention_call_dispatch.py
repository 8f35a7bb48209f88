"""The plain causal call's shortcuts in ops/attention.py and attention_dispatch.py: the remembered CPU choice is
choose_for's and follows the setting and the shapes, a call with nothing but causal and the scale is the call made
through every check, and the quick q/k/v check accepts only what the full checks accept."""

import itertools

import pytest
import torch

import selective_ckpt
from selective_ckpt import backend
from selective_ckpt.ops import attention as ops_attention
from selective_ckpt.ops import attention_dispatch as dispatch

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def ran(monkeypatch):
    """Which path ran each call: "itself" (the CPU flash kernel under its own node) or the op's kernel name."""
    log = []
    real = dispatch.forward
    monkeypatch.setattr(dispatch, "forward", lambda name, *a: log.append(name) or real(name, *a))
    monkeypatch.setattr(ops_attention.attention_dispatch, "forward", dispatch.forward)
    itself = dispatch.cpu_flash_as_itself
    monkeypatch.setattr(dispatch, "cpu_flash_as_itself", lambda *a: log.append("itself") or itself(*a))
    return log


def _ours_ran(monkeypatch):
    log = []
    real = ops_attention.backend.call

    def call(*a):
        log.append(a[:2])
        return real(*a)

    monkeypatch.setattr(ops_attention.backend, "call", call)
    return log


def qkv(B, H, Hkv, S, D, dtype, seed=0):
    """q [B, H, S, D] over [B, S, H, D] memory (a projection viewed into heads), k, v likewise."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, h, D, generator=g).to(dtype).transpose(1, 2) for h in (H, Hkv, Hkv))


def reference(q, k, v, causal=True):
    """float64 softmax(q k^T / sqrt(D)) v, heads grouped, causal top-left."""
    q, k, v = (t.double() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        Sq, Sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("name", ["auto", "ours", "sdpa", "sdpa_cpu_flash"])
def test_the_remembered_cpu_choice_is_choose_fors(name, setting):
    setting(name)
    for dtype, (B, S), causal, (H, Hkv) in itertools.product(
            (F32, BF16), ((2, 32), (1, 255), (1, 256), (0, 8), (2, 0)), (True, False), ((4, 2), (4, 4))):
        q, k, _ = qkv(B, H, Hkv, S, 16, dtype)
        expected = dispatch.choose_for(q, k, None, None, causal, 0, 0.0, 0.0, 0)
        for _ in range(2):  # the first call fills the memo, the second reads it
            assert dispatch.choose_plain_cpu(q, k, causal, backend.attention_setting()) == expected, \
                (name, dtype, B, S, causal, H, Hkv)


def test_the_remembered_choice_follows_the_setting_and_the_length(setting, ran):
    """A choice remembered for one setting and length is not reused for another: each call runs the kernel its
    setting and length pick, and every one meets the float64 reference."""
    for name, S, expected in (("auto", 32, ["itself"]), ("ours", 32, []), ("auto", 32, ["itself"]),
                              ("auto", 300, []), ("sdpa", 32, [dispatch.CPU_FLASH])):
        setting(name)
        ran.clear()
        q, k, v = (t.requires_grad_() for t in qkv(2, 4, 2, S, 16, F32, seed=S))
        o = selective_ckpt.attention(q, k, v, causal=True)
        assert ran == expected, (name, S)
        torch.testing.assert_close(o.double(), reference(q, k, v), atol=2e-5, rtol=1e-4)
        g = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        grads = torch.autograd.grad(o, (q, k, v), g.float())
        x, y, z = (t.detach().double().requires_grad_() for t in (q, k, v))
        expected_grads = torch.autograd.grad(reference(x, y, z), (x, y, z), g)
        for a, b in zip(grads, expected_grads):
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype, S, name", [(F32, 32, "auto"), (F32, 32, "ours"), (BF16, 40, "auto"),
                                            (F32, 300, "auto"), (F32, 32, "sdpa")])
@pytest.mark.parametrize("causal", [True, False])
def test_the_quick_call_is_the_checked_call(dtype, S, name, causal, setting):
    """A call with nothing but causal and the scale gives the bits, forward and backward, and the layout of the same
    call made through every check (dropout_p=0, an int, takes that path)."""
    setting(name)
    results = []
    for dropout_p in (0.0, 0):
        q, k, v = (t.requires_grad_() for t in qkv(2, 4, 2, S, 16, dtype))
        o = selective_ckpt.attention(q, k, v, causal, dropout_p, 0.3)
        o.backward(torch.ones_like(o))
        results.append((o.detach(), q.grad, k.grad, v.grad, o.stride()))
    for a, b in zip(*results):
        assert a == b if isinstance(a, tuple) else torch.equal(a, b)


@pytest.mark.parametrize("call, error, match", [
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(causal=True, softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
    (dict(causal=True, softmax_scale=torch.tensor(0.25)), TypeError, "softmax_scale must be a Python float"),
    (dict(causal=True, dropout_p=1.0), ValueError, "dropout_p must be in"),
    (dict(causal=True, q_offset=True), ValueError, "q_offset must be an int"),
    (dict(causal=True, q_offset=-1), ValueError, "q_offset must be >= 0"),
    (dict(causal=True, sliding_window=0), ValueError, "sliding_window must be a positive int"),
])
def test_the_quick_call_leaves_every_other_argument_to_its_check(call, error, match):
    q, k, v = qkv(1, 4, 2, 8, 16, F32)
    with pytest.raises(error, match=match):
        selective_ckpt.attention(q, k, v, **call)


def test_the_quick_call_checks_q_k_v():
    q, k, v = qkv(1, 4, 2, 8, 16, F32)
    with pytest.raises(TypeError, match="share one dtype"):
        selective_ckpt.attention(q, k.to(BF16), v, causal=True)
    with pytest.raises(ValueError, match="contiguous last dim"):
        selective_ckpt.attention(q, k, torch.randn(1, 2, 8, 32)[..., ::2], causal=True)


def _cases():
    """(name, q, k, v): valid calls and ones each check refuses."""
    q, k, v = qkv(2, 4, 2, 8, 16, F32)
    yield "valid", q, k, v
    yield "mha", *qkv(1, 2, 2, 5, 8, BF16)
    yield "value dim", q, k, torch.randn(2, 2, 8, 32)
    yield "empty batch", *qkv(0, 4, 2, 8, 16, F32)
    yield "empty queries", torch.randn(2, 4, 0, 16), k, v
    yield "no keys", q, torch.randn(2, 2, 0, 16), torch.randn(2, 2, 0, 16)
    yield "no keys, no queries", torch.randn(2, 4, 0, 16), torch.randn(2, 2, 0, 16), torch.randn(2, 2, 0, 16)
    yield "D = 1 strided", torch.randn(2, 4, 8, 2)[..., :1], torch.randn(2, 2, 8, 2)[..., :1], \
        torch.randn(2, 2, 8, 2)[..., :1]
    yield "not a tensor", q.tolist(), k, v
    yield "rank 3", q[0], k, v
    yield "float64", q.double(), k.double(), v.double()
    yield "mixed dtypes", q, k.to(BF16), v
    yield "meta k", q, k.to("meta"), v
    yield "batch", q, k[:1], v[:1]
    yield "head dim", q, torch.randn(2, 2, 8, 8), v
    yield "heads", q, torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)
    yield "no query heads", torch.randn(2, 0, 8, 16), k, v
    yield "more kv heads", torch.randn(2, 2, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    yield "v length", q, k, torch.randn(2, 2, 7, 16)
    yield "v heads", q, k, torch.randn(2, 1, 8, 16)
    yield "D too large", torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2, 300)
    yield "Dv too large", q, k, torch.randn(2, 2, 8, 300)
    yield "D = 0", torch.randn(1, 1, 2, 0), torch.randn(1, 1, 2, 0), torch.randn(1, 1, 2, 4)
    yield "strided last dim", torch.randn(2, 4, 8, 32)[..., ::2], k, v
    yield "strided v", q, k, torch.randn(2, 2, 8, 32)[..., ::2]


def _outcome(q, k, v):
    try:
        ops_attention._check_qkv(q, k, v)
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return None


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_the_quick_check_accepts_only_what_the_checks_accept(case, monkeypatch):
    _, q, k, v = case
    quick = ops_attention._plain_qkv(q, k, v)
    outcome = _outcome(q, k, v)
    monkeypatch.setattr(ops_attention, "_plain_qkv", lambda q, k, v: False)
    full = _outcome(q, k, v)
    assert outcome == full  # the same error, or none, as the checks alone give
    assert not (quick and full is not None)
