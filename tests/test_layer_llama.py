"""The Llama-style SelectiveDecoderLayer (RMSNorm, RoPE, grouped-query attention, SwiGLU / GeGLU)
against an eager Llama layer written here: float64 for the reference, the test dtype for eager's own
error (tests/reference.py's rule). k and v are expanded with repeat_interleave in the reference only.
"""

import pytest
import torch
import torch.nn.functional as F

from selective_ckpt import SelectiveDecoderLayer, memory, rng
from tests.reference import assert_within_rule

THETA = 10000.0


def _hf_rms_norm(x, w, eps):
    xf = x.float() if x.dtype != torch.float64 else x
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(t, positions, theta):
    """Hugging Face's apply_rotary_pos_emb on t [B, heads, S, D]: tables in float32 (float64 for the
    reference) cast to t's dtype, rotate_half form."""
    D = t.shape[-1]
    table_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=table_dtype) / D)
    freqs = positions.to(table_dtype)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(t.dtype)[:, None], emb.sin().to(t.dtype)[:, None]
    half = D // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


def _norm(layer, params, name, x):
    eps = getattr(layer, name).eps
    if layer.norm == "rmsnorm":
        return _hf_rms_norm(x, params[f"{name}.weight"], eps)
    return F.layer_norm(x, x.shape[-1:], params[f"{name}.weight"], params.get(f"{name}.bias"), eps)


def eager_llama(layer, params, x, positions=None, seeds=None, p=0.0, p_attn=0.0):
    """The layer's computation in plain PyTorch on `params` (a dict of the layer's tensors in any dtype):
    its norm (RMSNorm in Hugging Face's rounding order, or LayerNorm) and its MLP (gated or plain)."""
    B, S, h = x.shape
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    acts = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
    act = acts[layer.kernel_activation]
    u = _norm(layer, params, "ln1", x)
    qkv = F.linear(u, params["qkv.weight"], params.get("qkv.bias"))
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, D)).transpose(1, 2) for t in (q, k, v))
    if layer.rope_theta is not None:
        pos = positions if positions is not None else torch.arange(S)[None]
        q, k = _rope(q, pos, layer.rope_theta), _rope(k, pos, layer.rope_theta)
    k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    allowed = j <= i
    if layer.sliding_window:
        allowed &= j > i - layer.sliding_window
    if p_attn:
        scores = (q @ k.transpose(-1, -2)) * D**-0.5
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        keep = rng.attention_keep_mask(seeds[0], B, H, S, S, p_attn)
        o = torch.where(keep, probs * rng.keep_scale(p_attn), 0.0).to(v.dtype) @ v
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    a = F.linear(o.transpose(1, 2).reshape(B, S, H * D), params["proj.weight"], params.get("proj.bias"))
    if p:
        a = torch.where(rng.elementwise_keep_mask(seeds[1], B * S, h, p).reshape(a.shape), a * rng.keep_scale(p), 0.0)
    x1 = x + a
    u2 = _norm(layer, params, "ln2", x1)
    if layer.gated:
        m = F.linear(act(F.linear(u2, params["gate_proj.weight"], params.get("gate_proj.bias")))
                     * F.linear(u2, params["up_proj.weight"], params.get("up_proj.bias")),
                     params["down_proj.weight"], params.get("down_proj.bias"))
    else:
        m = F.linear(act(F.linear(u2, params["fc1.weight"], params.get("fc1.bias"))), params["fc2.weight"],
                     params.get("fc2.bias"))
    if p:
        m = torch.where(rng.elementwise_keep_mask(seeds[2], B * S, h, p).reshape(m.shape), m * rng.keep_scale(p), 0.0)
    return x1 + m


def _build(h, H, dtype, **kw):
    torch.manual_seed(0)
    kw = dict(norm="rmsnorm", activation="swiglu", bias=False, rope_theta=THETA) | kw
    layer = SelectiveDecoderLayer(h, H, dtype=dtype, **kw)
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, prm in layer.named_parameters():
            if name.startswith("ln"):
                prm.copy_(1 + 0.2 * torch.randn_like(prm))
            elif name.endswith("bias"):
                prm.copy_(0.1 * torch.randn_like(prm))
    return layer


def _grads(out, leaves, dy):
    return torch.autograd.grad(out, leaves, dy)


def check_layer(layer, B, S, dtype, positions=None):
    h = layer.hidden_dim
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(B, S, h, generator=g, dtype=torch.float64).to(dtype).double()
    dy64 = torch.randn(B, S, h, generator=g, dtype=torch.float64).to(dtype).double()
    names = [n for n, _ in layer.named_parameters()]
    x = x64.to(dtype).requires_grad_(True)
    y = layer(x, position_ids=positions)
    ours = _grads(y, [x, *layer.parameters()], dy64.to(dtype))
    results = {}
    for kind, cast in (("eager", dtype), ("ref", torch.float64)):
        params = {n: prm.detach().to(cast).requires_grad_(True) for n, prm in layer.named_parameters()}
        xi = x64.to(cast).requires_grad_(True)
        yi = eager_llama(layer, params, xi, positions)
        results[kind] = (yi, _grads(yi, [xi, *params.values()], dy64.to(cast)))
    assert_within_rule(y, results["eager"][0].detach(), results["ref"][0].detach(), 2, name="y")
    for name, o, e, r in zip(["x", *names], ours, results["eager"][1], results["ref"][1]):
        ulp = torch.finfo(dtype).eps * r.abs().max().item()  # floor: one ulp at the gradient's scale
        assert_within_rule(o, e, r, 3, floor=max(1e-5, ulp), name=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    dict(B=2, S=17, h=64, H=4),
    dict(B=1, S=33, h=48, H=3, activation="geglu", bias=True),
    dict(B=2, S=9, h=40, H=2, rope_theta=None, ffn_dim=77),
], ids=["swiglu", "geglu-bias", "norope-ffn77"])
def test_llama_layer_matches_float64_reference(case, dtype, use_backend):
    use_backend("cpp")
    case = dict(case)
    B, S, h, H = (case.pop(k) for k in ("B", "S", "h", "H"))
    check_layer(_build(h, H, dtype, **case), B, S, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm, activation", [("rmsnorm", "gelu"), ("rmsnorm", "gelu_tanh"), ("layernorm", "swiglu"),
                                              ("layernorm", "geglu")])
def test_any_norm_with_any_mlp_matches_float64_reference(norm, activation, dtype, use_backend):
    """RMSNorm with the plain GELU MLP and LayerNorm (with biases) with the gated MLPs: the combinations
    no model family had, against float64; the modes agree bit for bit, and the ledger equals the estimate."""
    use_backend("cpp")
    layer = _build(48, 4, dtype, norm=norm, activation=activation, bias=True, num_kv_heads=2, ffn_dim=72)
    check_layer(layer, 2, 13, dtype)
    x = torch.randn(2, 9, 48).to(dtype)
    _bitwise_modes(layer, x)
    layer.recompute = "selective"
    for mode in ("selective", "none"):
        layer.recompute = mode
        assert memory.ledger(layer, x.clone().requires_grad_(True)).total == memory.estimate(
            48, 4, 9, 2, dtype, recompute=mode, **{k: v for k, v in layer.shape().items()
                                                    if k not in ("hidden_dim", "num_heads", "dtype", "causal")})


def test_llama_layer_positions_and_triton_backend(backend):
    layer = _build(32, 2, torch.float32)
    check_layer(layer, 2, 7, torch.float32, positions=torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6]]))


def _bitwise_modes(layer, x, **kw):
    outs = []
    for mode in ("none", "selective", "full"):
        layer.recompute = mode
        torch.manual_seed(11)  # the same seeds in each mode
        xi = x.detach().clone().requires_grad_(True)
        y = layer(xi, **kw)
        grads = torch.autograd.grad(y, [xi, *layer.parameters()], torch.ones_like(y))
        outs.append((y, grads))
    for y, grads in outs[1:]:
        assert torch.equal(y, outs[0][0])
        for a, b in zip(grads, outs[0][1]):
            assert torch.equal(a, b)


def test_recompute_modes_are_bit_identical(backend):
    layer = _build(32, 2, torch.bfloat16, dropout=0.17, attn_dropout=0.17, bias=True).train()
    x = torch.randn(2, 9, 32).to(torch.bfloat16)
    _bitwise_modes(layer, x, position_ids=torch.arange(3, 12)[None])


def test_kept_bytes_are_the_floor():
    # x, q/k/v, o, x1, gate, up + lse (fp32 per head and row) + one fp32 rstd per RMSNorm
    B, S, h, H, ffn = 2, 11, 64, 4, 176
    layer = _build(h, H, torch.bfloat16, ffn_dim=ffn)
    x = torch.randn(B, S, h, dtype=torch.bfloat16, requires_grad=True)
    t = B * S
    floor = t * (h + 3 * h + h + h + 2 * ffn) * 2 + t * H * 4 + 2 * t * 4
    assert memory.ledger(layer, x).total == floor
    layer.recompute = "none"  # + both norm outputs and the product act(gate) * up
    assert memory.ledger(layer, x).total == floor + t * (2 * h + ffn) * 2


def test_rope_keeps_nothing_but_positions():
    layer = _build(32, 2, torch.float32)
    x = torch.randn(1, 5, 32, requires_grad=True)
    pos = torch.arange(5)[None]
    without = memory.ledger(layer, x).total
    assert memory.ledger(lambda t: layer(t, position_ids=pos), x).total == without + pos.numel() * 8


def test_bad_llama_arguments():
    with pytest.raises(ValueError, match="num_kv_heads"):
        SelectiveDecoderLayer(64, 4, num_kv_heads=3, norm="rmsnorm", activation="swiglu")
    with pytest.raises(ValueError, match="activation must be one of"):
        SelectiveDecoderLayer(64, 4, norm="rmsnorm", activation="relu")
    with pytest.raises(ValueError, match="norm must be one of"):
        SelectiveDecoderLayer(64, 4, norm="batchnorm")
    with pytest.raises(ValueError, match="even head dim"):
        SelectiveDecoderLayer(60, 4, norm="rmsnorm", activation="swiglu", rope_theta=1e4)
    with pytest.raises(ValueError, match="sliding_window"):
        SelectiveDecoderLayer(64, 4, norm="rmsnorm", activation="swiglu", sliding_window=0)
    with pytest.raises(ValueError, match="ffn_dim"):
        SelectiveDecoderLayer(64, 4, norm="rmsnorm", activation="swiglu", ffn_dim=0)
    layer = SelectiveDecoderLayer(64, 4, norm="rmsnorm", activation="swiglu", rope_theta=1e4)
    with pytest.raises(ValueError, match="position_ids must have shape"):
        layer(torch.randn(2, 5, 64), position_ids=torch.arange(4)[None])
    with pytest.raises(TypeError, match="position_ids must be an int"):
        layer(torch.randn(2, 5, 64), position_ids=torch.arange(5.0)[None])


# Grouped-query and windowed attention.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_layer_matches_float64_reference(dtype, use_backend):
    use_backend("cpp")
    check_layer(_build(64, 8, dtype, num_kv_heads=2), 2, 17, dtype)


def test_gqa_layer_both_backends_and_modes(backend):
    check_layer(_build(32, 4, torch.float32, num_kv_heads=1), 1, 9, torch.float32)
    layer = _build(32, 4, torch.bfloat16, num_kv_heads=2, dropout=0.17, attn_dropout=0.17).train()
    _bitwise_modes(layer, torch.randn(2, 7, 32).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_layer_matches_float64_reference(dtype, use_backend):
    use_backend("cpp")
    check_layer(_build(64, 4, dtype, sliding_window=5), 2, 17, dtype)


def test_gqa_window_layer_both_backends(backend):
    check_layer(_build(32, 4, torch.bfloat16, num_kv_heads=2, sliding_window=3), 2, 9, torch.bfloat16)


def test_gqa_kept_bytes_are_the_llama_floor():
    # Llama-3-8B's proportions scaled down: H = 32 -> 8, Hkv = H / 4, ffn = 3.5 h, bf16: 11.5 h per
    # token of activations (x, q, k/v at Hkv, o, x1, gate, up) + lse + two rstd.
    B, S, h, H = 2, 13, 256, 8
    layer = _build(h, H, torch.bfloat16, num_kv_heads=2, ffn_dim=int(3.5 * h))
    x = torch.randn(B, S, h, dtype=torch.bfloat16, requires_grad=True)
    t = B * S
    floor = t * int(11.5 * h) * 2 + t * H * 4 + 2 * t * 4
    assert memory.ledger(layer, x).total == floor
    assert memory.estimate(h, H, S, B, torch.bfloat16, num_kv_heads=2, ffn_dim=int(3.5 * h), norm="rmsnorm",
                           activation="swiglu") == floor


def test_torch_compile_fullgraph_matches_eager(use_backend):
    use_backend("cpp")  # the interpreter cannot be traced; CPU compile goes through the C++ ops
    layer = _build(32, 2, torch.float32, bias=True)
    x, dy = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    pos = torch.arange(2, 9)[None]
    eager = torch.autograd.grad(layer(x.requires_grad_(True), position_ids=pos), [x, *layer.parameters()], dy)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    x2 = x.detach().clone().requires_grad_(True)
    got = torch.autograd.grad(compiled(x2, position_ids=pos), [x2, *layer.parameters()], dy)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
