"""memory.estimate: the formulas, and estimate == ledger on SelectiveDecoderLayer for every mode and dtype."""


import pytest
import torch
from torch import nn

from selective_ckpt import memory

F32 = 4


# ---------------------------------------------------------------------------------------------
# Estimate


@pytest.mark.parametrize("dtype,e", [(torch.float32, 4), (torch.bfloat16, 2), ("fp16", 2)])
def test_estimate_formulas(dtype, e):
    h, a, s, b = 64, 4, 9, 3
    t = s * b
    extra = a * t * 4 + 2 * 2 * t * 4  # lse + LayerNorm mean/rstd, fp32
    assert memory.estimate(h, a, s, b, dtype, recompute="selective") == 10 * t * h * e + extra
    assert memory.estimate(h, a, s, b, dtype, recompute="none") == 16 * t * h * e + extra
    assert memory.estimate(h, a, s, b, dtype, recompute="full") == t * h * e
    # mlp_ratio 2: fc1 output (and GELU output for "none") are 2h wide
    assert memory.estimate(h, a, s, b, dtype, mlp_ratio=2, recompute="selective") == 8 * t * h * e + extra
    assert memory.estimate(h, a, s, b, dtype, mlp_ratio=2, recompute="none") == 12 * t * h * e + extra
    parts = memory.estimate(h, a, s, b, dtype, breakdown=True)
    assert sum(parts.values()) == memory.estimate(h, a, s, b, dtype)
    assert parts["lse"] == a * t * 4


def test_estimate_design_7b_cut():
    # docs/DESIGN.md: 20 bytes per s*b*h in bf16 at the 7B shape (plus lse and LN stats)
    h, a, s = 4096, 32, 2048
    est = memory.estimate(h, a, s, 1, torch.bfloat16)
    assert est - (a * s * 4 + 4 * s * 4) == 20 * s * h


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_dim=10, num_heads=3), "divisible"),
    (dict(hidden_dim=0), "hidden_dim"),
    (dict(seq_len=0), "seq_len"),
    (dict(batch=1.5), "batch"),
    (dict(recompute="some"), "recompute"),
    (dict(mlp_ratio=-1), "mlp_ratio"),
])
def test_estimate_rejects_bad_arguments(kwargs, match):
    args = dict(hidden_dim=16, num_heads=2, seq_len=4, batch=1, dtype=torch.float32) | kwargs
    with pytest.raises(ValueError, match=match):
        memory.estimate(**args)


def test_estimate_rejects_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        memory.estimate(16, 2, 4, 1, torch.int32)
    with pytest.raises(TypeError, match="dtype"):
        memory.estimate(16, 2, 4, 1, "int8")


# ---------------------------------------------------------------------------------------------
# estimate == ledger on the layer


LAYER_CASES = [(1, 5, 32, 2), (2, 17, 48, 3), (3, 9, 64, 4)]  # (batch, seq, hidden, heads)


@pytest.mark.parametrize("mode", memory.MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_equals_ledger_on_the_layer(mode, dtype):
    layers = pytest.importorskip("selective_ckpt.layers")
    torch.manual_seed(0)
    for b, s, h, a in LAYER_CASES:
        layer = layers.SelectiveDecoderLayer(h, a, recompute=mode, dtype=dtype)
        x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
        rep = memory.ledger(layer, x)
        assert rep.total == memory.estimate(h, a, s, b, dtype, recompute=mode), rep.table()
        assert dict(rep.by_layer) == {"SelectiveDecoderLayer": rep.total}


@pytest.mark.parametrize("mode", memory.MODES)
def test_estimate_equals_ledger_with_dropout(mode):
    layers = pytest.importorskip("selective_ckpt.layers")
    h, a, s, b = 32, 4, 7, 2
    for p, p_attn in ((0.1, 0.0), (0.0, 0.2), (0.1, 0.2)):
        layer = layers.SelectiveDecoderLayer(h, a, dropout=p, attn_dropout=p_attn, recompute=mode)
        rep = memory.ledger(layer, torch.randn(b, s, h, requires_grad=True))
        assert rep.total == memory.estimate(h, a, s, b, torch.float32, recompute=mode, dropout=p,
                                            attn_dropout=p_attn), rep.table()


def test_estimate_equals_ledger_for_a_fractional_mlp_ratio():
    # 60 * 4.1 is 245.99999999999997 in floating point: estimate must size fc1 as the layer does.
    layers = pytest.importorskip("selective_ckpt.layers")
    h, a, s, b, ratio = 60, 4, 5, 2, 4.1
    layer = layers.SelectiveDecoderLayer(h, a, mlp_ratio=ratio)
    assert layer.fc1.out_features == 246
    rep = memory.ledger(layer, torch.randn(b, s, h, requires_grad=True))
    assert rep.total == memory.estimate(h, a, s, b, torch.float32, mlp_ratio=ratio)


def test_ledger_per_layer_in_a_stack():
    layers = pytest.importorskip("selective_ckpt.layers")
    torch.manual_seed(0)
    h, a, s, b = 32, 2, 6, 2
    stack = nn.Sequential(*(layers.SelectiveDecoderLayer(h, a, recompute=m) for m in ("none", "selective", "full")))
    x = torch.randn(b, s, h, requires_grad=True)
    rep = memory.ledger(stack, x)
    assert list(rep.by_layer.values()) == [memory.estimate(h, a, s, b, torch.float32, recompute=m)
                                           for m in ("none", "selective", "full")]


# ---------------------------------------------------------------------------------------------
# Llama-style layers (RMSNorm, gated MLP, RoPE; kv heads = heads until grouped-query kernels run)

LLAMA_CASES = [  # (batch, seq, hidden, heads, layer kwargs)
    (1, 5, 32, 2, dict(activation="swiglu", rope_theta=1e4)),
    (2, 17, 48, 3, dict(activation="geglu", ffn_dim=77, bias=True)),
    (3, 9, 64, 4, dict(activation="swiglu", mlp_ratio=3.5, rope_theta=5e5, sliding_window=None)),
]


def _llama_layer(layers, h, a, mode, dtype, kw, **extra):
    kw = dict(kw)
    ratio = kw.pop("mlp_ratio", 4.0)
    bias = kw.pop("bias", False)
    return layers.SelectiveDecoderLayer(h, a, mlp_ratio=ratio, recompute=mode, dtype=dtype, norm="rmsnorm",
                                        bias=bias, **kw, **extra), ratio, kw


@pytest.mark.parametrize("mode", memory.MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_equals_ledger_on_llama_layers(mode, dtype):
    layers = pytest.importorskip("selective_ckpt.layers")
    torch.manual_seed(0)
    for b, s, h, a, kw in LLAMA_CASES:
        layer, ratio, shape_kw = _llama_layer(layers, h, a, mode, dtype, kw)
        rep = memory.ledger(layer, torch.randn(b, s, h, dtype=dtype, requires_grad=True))
        est = memory.estimate(h, a, s, b, dtype, mlp_ratio=ratio, recompute=mode, norm="rmsnorm", **shape_kw)
        assert rep.total == est, rep.table()


@pytest.mark.parametrize("mode", memory.MODES)
def test_estimate_equals_ledger_on_llama_layers_with_dropout(mode):
    layers = pytest.importorskip("selective_ckpt.layers")
    b, s, h, a, kw = LLAMA_CASES[0]
    layer, ratio, shape_kw = _llama_layer(layers, h, a, mode, torch.float32, kw, dropout=0.1, attn_dropout=0.2)
    rep = memory.ledger(layer, torch.randn(b, s, h, requires_grad=True))
    assert rep.total == memory.estimate(h, a, s, b, torch.float32, mlp_ratio=ratio, recompute=mode, dropout=0.1,
                                        attn_dropout=0.2, norm="rmsnorm", **shape_kw), rep.table()


def test_estimate_llama_formulas():
    # Llama-3-8B: h 4096, H 32, Hkv 8, ffn 14336 (3.5h), bf16: 11.5h per token + lse + two rstd.
    h, a, s = 4096, 32, 2048
    kw = dict(num_kv_heads=8, ffn_dim=14336, norm="rmsnorm", activation="swiglu", rope_theta=5e5)
    parts = memory.estimate(h, a, s, 1, torch.bfloat16, breakdown=True, **kw)
    assert parts["qkv"] == s * (h + 2 * 8 * 128) * 2 and parts["norm_stats"] == 2 * s * 4
    assert sum(parts.values()) - (a * s * 4 + 2 * s * 4) == int(11.5 * s * h) * 2
    none = memory.estimate(h, a, s, 1, torch.bfloat16, recompute="none", **kw)
    assert none - sum(parts.values()) == s * (2 * h + 14336) * 2  # both norm outputs and the product
    with pytest.raises(ValueError, match="num_kv_heads"):
        memory.estimate(h, a, s, 1, torch.bfloat16, num_kv_heads=5, norm="rmsnorm", activation="swiglu")
    with pytest.raises(ValueError, match="activation must be one of"):
        memory.estimate(h, a, s, 1, torch.bfloat16, activation="relu")
    # GQA's smaller qkv: fewer FLOPs than the same MLP FLOPs (3 * 3.5h = 2 * 5.25h) with full heads
    assert memory.forward_flops(h, a, s, 1, **kw) < memory.forward_flops(h, a, s, 1, mlp_ratio=5.25)


@pytest.mark.parametrize("mode", memory.MODES)
def test_estimate_equals_ledger_on_grouped_query_layers(mode):
    layers = pytest.importorskip("selective_ckpt.layers")
    for b, s, h, a, kv in [(2, 9, 64, 8, 2), (1, 13, 48, 4, 1)]:
        kw = dict(num_kv_heads=kv, ffn_dim=int(3.5 * h), activation="swiglu", rope_theta=1e4)
        layer = layers.SelectiveDecoderLayer(h, a, recompute=mode, dtype=torch.bfloat16, norm="rmsnorm", bias=False,
                                             **kw)
        rep = memory.ledger(layer, torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True))
        est = memory.estimate(h, a, s, b, torch.bfloat16, recompute=mode, norm="rmsnorm", **kw)
        assert rep.total == est, rep.table()
