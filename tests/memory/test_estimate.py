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
