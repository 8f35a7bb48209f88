"""The "selective_ckpt" attention function with gpt-oss's attention sinks (the s_aux its attention module
passes): against transformers' gpt_oss eager attention in float64, causal, sliding window, left padding
(rows that attend nothing give 0 in both: the sink takes their mass), GQA; gradients of q, k, v and the
module's sinks parameter."""

import pytest
import torch

from selective_ckpt.models import attention as hf_attention
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


def _module(dtype):
    config = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                       sliding_window=5)
    module = gpt_oss.GptOssAttention(config, 0).to(dtype)
    with torch.no_grad():
        module.sinks.copy_(torch.tensor([1.5, -0.5, 0.0, 3.0]))
    return module


def _mask(pad, S, window=None):
    """transformers' SDPA mask: causal (within the window) and key padding, [B, 1, S, S] bool (True = attend)."""
    i = torch.arange(S)
    allowed = i[None, :] <= i[:, None]
    if window:
        allowed &= i[:, None] - i[None, :] < window
    return (allowed[None] & pad[:, None, :])[:, None]


def _run(fn, module, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    module.sinks.grad = None
    o = fn(module, q, k, v)
    o.backward(grad.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad, module.sinks.grad.clone()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sinks_reach_our_kernel_within_the_rule(window, dtype):
    B, H, Hkv, S, D = 2, 4, 2, 13, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), \
        torch.randn(B, Hkv, S, D, generator=g)
    grad = torch.randn(B, S, H, D, generator=g)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, :4] = False  # left padding: rows 0..3 of batch 1 attend nothing
    mask = _mask(pad, S, window)
    scale = D**-0.5

    def ours(module, a, b, c):
        return hf_attention.selective_attention(module, a, b, c, mask, scaling=scale, sliding_window=window,
                                                s_aux=module.sinks)[0]

    def eager(module, a, b, c):
        additive = torch.zeros(mask.shape, dtype=a.dtype).masked_fill(~mask, torch.finfo(a.dtype).min)
        return gpt_oss.eager_attention_forward(module, a, b, c, additive, scaling=scale)[0]

    m = _module(dtype)
    got = _run(ours, m, q.to(dtype), k.to(dtype), v.to(dtype), grad)
    plain = _run(eager, m, q.to(dtype), k.to(dtype), v.to(dtype), grad)
    ref = _run(eager, _module(torch.float64), q.double(), k.double(), v.double(), grad)
    assert torch.equal(got[0][1, :4], torch.zeros(4, H, D, dtype=dtype))  # the sink takes those rows' mass
    assert torch.equal(ref[0][1, :4], torch.zeros(4, H, D, dtype=torch.float64))
    for what, x, e, r, factor in zip(("o", "dq", "dk", "dv", "dsinks"), got, plain, ref, (2, 3, 3, 3, 3)):
        assert_within_rule(x, e, r, factor, name=f"{dtype} {what}")


def test_calls_our_kernels_leave_to_transformers_take_the_sinks_too():
    """A call with earlier keys (Sq != Sk) goes to the family's eager attention, not SDPA (which has no sinks)."""
    m = _module(torch.float32)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    ours = hf_attention.selective_attention(m, q, k, v, None, scaling=0.25, s_aux=m.sinks)[0]
    eager = gpt_oss.eager_attention_forward(m, q, k, v, None, scaling=0.25)[0]
    torch.testing.assert_close(ours, eager)
