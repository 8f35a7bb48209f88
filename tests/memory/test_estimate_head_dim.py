"""memory.estimate with an explicit head_dim whose query width heads x head_dim is not the hidden size (gpt-oss,
Gemma, Qwen3 variants): a converted layer keeps exactly the estimate's bytes (selective, none); head_dim =
hidden / heads gives the bytes it gave without it."""

import pytest
import torch

from selective_ckpt import convert, memory, set_recompute
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers, state_of
from tests.models.hf_checks import VOCAB, batch, kept_bytes_per_layer

transformers = pytest.importorskip("transformers")

# hidden 48, 4 heads: q is 64 wide (head_dim 16) or 32 (head_dim 8), never 48
_BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_attention_heads=4,
             max_position_embeddings=64, pad_token_id=0)
CASES = {
    "llama-16": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(head_dim=16, num_key_value_heads=4)),
    "qwen3-8": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=8, num_key_value_heads=4)),
    "gqa-16": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(head_dim=16, num_key_value_heads=2)),
}


def _build(case, layers, mode):
    config_cls, model_cls, kw = CASES[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**_BASE, **kw, num_hidden_layers=layers)).train()
    model.config._attn_implementation = "sdpa"
    model = convert(model)
    set_recompute(model, mode)
    return model


@pytest.mark.parametrize("case, mode", [("llama-16", "selective"), ("llama-16", "none"), ("qwen3-8", "selective"),
                                        ("qwen3-8", "none"), ("gqa-16", "selective")])
def test_converted_layer_keeps_its_estimate(case, mode):
    ids, _ = batch(b=2, s=12, pad_rows=False)
    layer = recomputable_layers(_build(case, 1, mode))[0]
    shape = state_of(layer).shape()
    assert shape["head_dim"] * shape["num_heads"] != shape["hidden_dim"]
    ours = kept_bytes_per_layer(lambda n: _build(case, n, mode), {"input_ids": ids})
    assert ours == layer_estimate(layer, ids.shape[1], ids.shape[0])


def test_head_dim_sizes_the_query_wide_parts():
    h, a, kv, d, s, b = 48, 4, 2, 16, 5, 3
    t, e = s * b, 4
    shape = dict(num_kv_heads=kv, norm="rmsnorm", activation="swiglu", ffn_dim=80)
    wide = memory.estimate(h, a, s, b, torch.float32, breakdown=True, head_dim=d, **shape)
    assert wide["qkv"] == t * (a * d + 2 * kv * d) * e
    assert wide["o"] == t * a * d * e
    assert wide["x"] == wide["x1"] == t * h * e  # the residual stream stays hidden wide
    kept = memory.estimate(h, a, s, b, torch.float32, recompute="attention-kept", breakdown=True, head_dim=d, **shape)
    assert kept["o"] == t * a * d * e
    norms = memory.estimate(h, a, s, b, torch.float32, breakdown=True, head_dim=8, qk_norm=True, recompute="none",
                            attn_gate=True, **shape)
    assert norms["qk_norm_in"] == t * (2 * a + kv) * 8 * e
    assert norms["attn_gate_product"] == t * a * 8 * e
    assert norms["ln1_out"] == t * h * e


@pytest.mark.parametrize("kw", [dict(), dict(qk_norm=True, recompute="none"), dict(recompute="attention-kept"),
                                dict(residual="post-norm", qk_norm="projection"), dict(qk_norm="rotated")])
def test_head_dim_of_hidden_over_heads_changes_nothing(kw):
    args = (64, 4, 7, 2, torch.bfloat16)
    shape = dict(num_kv_heads=2, norm="rmsnorm", activation="swiglu", **kw)
    assert memory.estimate(*args, breakdown=True, head_dim=16, **shape) == memory.estimate(*args, breakdown=True,
                                                                                            **shape)
    assert memory.forward_flops(64, 4, 7, 2, head_dim=16) == memory.forward_flops(64, 4, 7, 2)


@pytest.mark.parametrize("head_dim", [0, -8, 16.0, "16", True])
def test_bad_head_dim_is_refused(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        memory.estimate(48, 4, 5, 1, torch.float32, head_dim=head_dim)


def test_odd_head_dim_with_rope_is_refused():
    with pytest.raises(ValueError, match="head_dim = 7"):
        memory.estimate(48, 4, 5, 1, torch.float32, head_dim=7, rope_theta=10000.0)
    assert memory.estimate(48, 4, 5, 1, torch.float32, head_dim=7) > 0  # no RoPE: any width


def test_planner_reads_head_dim():
    model = _build("gqa-16", 2, "selective")
    shape = state_of(recomputable_layers(model)[0]).shape()
    plan = memory.plan(model, 2, 12, budget_bytes=10**9)
    assert plan.kept_bytes == sum(memory.estimate(seq_len=12, batch=2, recompute=m, **shape) for m in plan)
    assert plan.kept_bytes != sum(memory.estimate(seq_len=12, batch=2, recompute=m, **{**shape, "head_dim": None})
                                  for m in plan)
