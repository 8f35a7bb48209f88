"""selective_attention's plain causal call (no mask, window, dropout, soft-cap or sinks) and what follows it: each call
meets an independent float64 reference whatever ran before (another length, a padding mask, a window, a changed
attention setting), and q, k, v are kept as attention kept them before (_own_buffers)."""

import pytest
import torch

from selective_ckpt import backend
from selective_ckpt.models import attention as model_attention


@pytest.fixture
def module():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaAttention(config, layer_idx=0)


def qkv(B, S, seed):
    """q [B, 4, S, 16], k, v [B, 2, S, 16] over [B, S, heads, D] memory, as a layer passes them."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, h, 16, generator=g).transpose(1, 2).requires_grad_() for h in (4, 2, 2))


def reference(q, k, v, allowed, scaling):
    """float64 eager attention: softmax(q k^T * scaling, masked to `allowed` [B, S, S]) v, heads grouped."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def causal(B, S, window=None):
    i = torch.arange(S)
    allowed = i[:, None] >= i[None, :]
    if window:
        allowed &= i[:, None] - i[None, :] < window
    return allowed.expand(B, S, S)


def run(module, q, k, v, mask=None, **kwargs):
    o, weights = model_attention.selective_attention(module, q, k, v, mask, dropout=0.0, scaling=module.scaling,
                                                     position_ids=None, use_cache=False, **kwargs)
    assert weights is None
    return o


@pytest.mark.parametrize("setting", ["auto", "ours"])
def test_each_call_meets_the_reference_whatever_ran_before(module, setting, monkeypatch):
    monkeypatch.setenv(backend.ATTENTION_ENV, setting)
    B, S = 2, 24
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, 17:] = False  # right padding: every row attends something
    padded = causal(B, S) & pad[:, None, :]
    calls = [  # (S, sdpa mask or None, kwargs, allowed)
        (S, None, {}, causal(B, S)),
        (S, padded[:, None], {}, padded),
        (S, None, {}, causal(B, S)),
        (S, None, {"sliding_window": 5}, causal(B, S, 5)),
        (S, None, {}, causal(B, S)),
        (300, None, {}, causal(B, 300)),
        (S, None, {}, causal(B, S)),
    ]
    for n, (length, mask, kwargs, allowed) in enumerate(calls):
        q, k, v = qkv(B, length, n)
        o = run(module, q, k, v, mask, **kwargs)
        expected = reference(q, k, v, allowed, module.scaling)
        live = allowed.any(-1)[:, :, None, None]
        torch.testing.assert_close(o.double() * live, expected * live, atol=2e-5, rtol=1e-4, msg=f"call {n}")


def test_a_changed_setting_is_followed(module, monkeypatch):
    """The plain call runs the kernel of the setting current at the call: the CPU flash kernel under "auto" (its
    own autograd node), ours under "ours" (the op's node), both meeting the reference."""
    nodes = []
    for setting in ("auto", "ours", "auto"):
        monkeypatch.setenv(backend.ATTENTION_ENV, setting)
        q, k, v = qkv(2, 16, 0)
        o = run(module, q, k, v)
        nodes.append(type(o.grad_fn.next_functions[0][0]).__name__)
        torch.testing.assert_close(o.double(), reference(q, k, v, causal(2, 16), module.scaling), atol=2e-5,
                                   rtol=1e-4)
    assert nodes[0] == nodes[2] != nodes[1]
    assert "Flash" in nodes[0]


def _own_buffers_as_specified(query, key, value, value_buffer_kept=False):
    """The rule of _own_buffers, written out: a tensor viewing a larger storage that neither other one views (nor,
    for v, one the layer keeps) is copied."""
    out = [query, key, value]
    ids = [t.untyped_storage()._cdata for t in out]
    for i, t in enumerate(out):
        shared = ids.count(ids[i]) > 1 or (i == 2 and value_buffer_kept)
        if not shared and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            out[i] = t.contiguous() if not t.is_contiguous() else t.clone()
    return out


def _layouts():
    B, S = 2, 8
    packed = torch.randn(B, S, 3 * 4 * 16)  # GPT-2's c_attn output: q, k, v views of one buffer
    q, k, v = (t.view(B, S, 4, 16).transpose(1, 2) for t in packed.split(64, -1))
    yield "one buffer for all", (q, k, v), False
    neox = torch.randn(B, S, 4, 3 * 16)  # GPT-NeoX's query_key_value: new q, k from RoPE, v still a view
    yield "v a view", (torch.randn(B, 4, S, 16), torch.randn(B, 4, S, 16), neox[..., 32:].transpose(1, 2)), False
    yield "v a view the layer keeps", (torch.randn(B, 4, S, 16), torch.randn(B, 4, S, 16),
                                       neox[..., 32:].transpose(1, 2)), True
    kv = torch.randn(B, S, 2 * 2 * 16)
    k, v = (t.view(B, S, 2, 16).transpose(1, 2) for t in kv.split(32, -1))
    yield "k and v share", (torch.randn(B, 4, S, 16), k, v), False
    yield "contiguous slice", (torch.randn(B, 4, S, 16), torch.randn(4, 2, S, 16)[:B], torch.randn(B, 2, S, 16)), \
        False
    yield "own storages", qkv(B, S, 0), False


@pytest.mark.parametrize("layout", list(_layouts()), ids=lambda c: c[0])
def test_own_buffers_keeps_its_rule(layout):
    _, tensors, kept = layout
    with torch.enable_grad():
        got = model_attention._own_buffers(*tensors, kept)
    expected = _own_buffers_as_specified(*tensors, kept)
    for g, e, t in zip(got, expected, tensors):
        assert (g is t) == (e is t)
        assert torch.equal(g, t) and g.stride() == e.stride()
        assert g.untyped_storage().nbytes() == g.numel() * g.element_size() or g is t
