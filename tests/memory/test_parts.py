"""memory/parts.py: a layer's parts, each entering what it keeps; estimate sums them, so a new form is a new part
handed in `parts` (and LayerShape.parts), not a new keyword. Counted by hand against the floor's formulas."""

import dataclasses

import pytest
import torch

from selective_ckpt import memory
from selective_ckpt.memory.parts import Attention, DenseMLP, Residual, Scalars, layer_parts, with_part


@dataclasses.dataclass(frozen=True)
class ScaledExpertInput:
    """A form no keyword names: each routed row's input scaled by its routing weight, kept for the weight's
    gradient (t * top_k rows of hidden width, in the layer's dtype)."""

    top_k: int

    def keep(self, kept, sizes):
        if sizes.rebuilds:
            kept["scaled_expert_in"] = sizes.t * self.top_k * sizes.hidden * sizes.e


# an odd Llama-shaped layer: hidden 72, 6 heads of 12, 2 kv heads, ffn 136 (mlp_ratio 136/72), 11 x 3 tokens
H, A, KV, S, B, FFN = 72, 6, 2, 11, 3, 136
KW = dict(num_kv_heads=KV, ffn_dim=FFN, norm="rmsnorm", activation="swiglu")


def _llama_selective(t, e):
    d = H // A
    return t * (H + (H + 2 * KV * d) + H + H + 2 * FFN) * e + A * t * 4 + 2 * t * 4


@pytest.mark.parametrize("dtype,e", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_the_floor_is_the_sum_of_its_parts(dtype, e):
    t = S * B
    est = memory.estimate(H, A, S, B, dtype, FFN / H, **KW)
    assert est == _llama_selective(t, e)
    assert [type(p) for p in layer_parts(gated=True)] == [Residual, Attention, DenseMLP]
    assert [type(p) for p in layer_parts(scalar_multipliers=2, gated=True)][-1] is Scalars


@pytest.mark.parametrize("recompute", ["none", "selective", "full", "attention-kept"])
def test_a_new_form_is_a_part(recompute):
    t = S * B
    base = memory.estimate(H, A, S, B, torch.bfloat16, FFN / H, recompute=recompute, **KW)
    parts = memory.estimate(H, A, S, B, torch.bfloat16, FFN / H, recompute=recompute, breakdown=True,
                            parts=(ScaledExpertInput(top_k=3),), **KW)
    extra = t * 3 * H * 2 if recompute in ("none", "selective") else 0
    assert sum(parts.values()) == base + extra
    assert parts.get("scaled_expert_in", 0) == extra
    if recompute == "selective":
        assert base == _llama_selective(t, 2)


def test_a_layer_shape_carries_its_parts_to_the_planner():
    shape = memory.LayerShape(hidden_dim=H, num_heads=A, mlp_ratio=FFN / H, dtype=torch.bfloat16, **KW)
    wider = dataclasses.replace(shape, parts=(ScaledExpertInput(top_k=3),))
    assert wider.parts[-1] == ScaledExpertInput(top_k=3)
    assert [type(p) for p in shape.parts] == [Residual, Attention, DenseMLP]
    plain = memory.plan(shape, B, S, 2 ** 40, num_layers=5, modes=("selective",))
    more = memory.plan(wider, B, S, 2 ** 40, num_layers=5, modes=("selective",))
    assert more.kept_bytes - plain.kept_bytes == 5 * S * B * 3 * H * 2


def test_parts_without_keep_and_forms_no_layer_has_are_refused():
    with pytest.raises(TypeError, match="parts: int has no keep"):
        memory.estimate(H, A, S, B, torch.float32, parts=(3,))
    mixer = memory.Mixer("GatedDeltaNet", lambda *args: 1000)
    with pytest.raises(ValueError, match="qk_norm=True.*mixer 'GatedDeltaNet'"):
        memory.estimate(H, A, S, B, torch.float32, qk_norm=True, mixer=mixer)
    with pytest.raises(ValueError, match="attn_gate=True"):
        memory.estimate(H, A, S, B, torch.float32, attn_gate=True, mixer=dataclasses.replace(mixer, attention=True))
    kept = memory.estimate(H, A, S, B, torch.float32, mixer=mixer, breakdown=True)
    assert kept["mixer"] == 1000 and "qkv" not in kept and "o" not in kept


def _forms():
    """(estimate's form keywords, the same layer as its whole part list) for the forms the keywords name."""
    mixer = memory.Mixer("GatedDeltaNet", lambda s, b, *dtypes: 37 * s * b)
    moe = memory.MoE(num_experts=5, top_k=2, expert_dim=40, shared_dim=24)
    return [({}, (Residual(), Attention(), DenseMLP(gated=True))),
            (dict(residual="parallel", norms=1), (Residual("parallel", 1), Attention(), DenseMLP(gated=True))),
            (dict(residual="post-norm", qk_norm="projection"),
             (Residual("post-norm"), Attention("projection"), DenseMLP(gated=True))),
            (dict(post_norms=True, qk_norm=True, scalar_multipliers=2),
             (Residual(post_norms=True), Attention(True), DenseMLP(gated=True), Scalars(2))),
            (dict(qk_norm=True, attn_gate=True, moe=moe), (Residual(), Attention(True, gate=True), moe)),
            (dict(mixer=mixer, moe=moe), (Residual(), mixer, moe)),
            (dict(qk_norm="rotated", mixer=dataclasses.replace(mixer, attention=True)),
             (Residual(), Attention("rotated"), dataclasses.replace(mixer, attention=True), DenseMLP(gated=True)))]


@pytest.mark.parametrize("recompute", ["selective", "none", "full", "attention-kept"])
@pytest.mark.parametrize("dtypes", [dict(dtype=torch.float32),
                                    dict(dtype=torch.bfloat16, residual_dtype=torch.float32)])
def test_a_whole_layer_as_parts_keeps_what_its_keywords_do(recompute, dtypes):
    for forms, layer in _forms():
        by_keywords = memory.estimate(H, A, S, B, mlp_ratio=FFN / H, recompute=recompute, breakdown=True, **dtypes,
                                      **forms, **KW)
        by_parts = memory.estimate(H, A, S, B, mlp_ratio=FFN / H, recompute=recompute, breakdown=True, **dtypes,
                                   parts=layer, **KW)
        assert by_parts == by_keywords, forms
        shape = memory.LayerShape(hidden_dim=H, num_heads=A, mlp_ratio=FFN / H, parts=layer, **KW)
        assert shape.parts == layer


@pytest.mark.parametrize("recompute", ["selective", "none"])
def test_llama4_attention_is_a_part(recompute):
    """Rotated q/k norms without a weight (q, k rotated in the matmuls' dtype, a row of ones per norm) and q scaled
    per position, under bf16 autocast over an fp32 residual stream, counted by hand."""
    t, d = S * B, H // A
    layer = (Residual(), Attention("rotated", weightless=True, query_scales=True), DenseMLP(gated=True))
    kept = memory.estimate(H, A, S, B, torch.bfloat16, FFN / H, recompute=recompute, residual_dtype=torch.float32,
                           parts=layer, breakdown=True, **KW)
    by_hand = {"x": t * H * 4, "x1": t * H * 4, "norm_stats": 2 * t * 4, "o": t * H * 2, "lse": A * t * 4,
               "qkv": t * ((A + KV) * d * 2 + KV * d * 2), "qk_norm_stats": t * (A + KV) * 4,
               "qk_norm_ones": 2 * d * 2, "query_scales": S * 4, "gate_out": t * FFN * 2, "up_out": t * FFN * 2}
    if recompute == "none":
        by_hand.update(ln1_out=t * H * 2, ln2_out=t * H * 2, qk_norm_out=t * (A + KV) * d * 2, product=t * FFN * 2)
    assert kept == by_hand


def test_latent_attention_is_a_part_the_planner_carries():
    """DeepSeek-V3's memory.MLA in attention's place: the planner's layer keeps what estimate counts for it."""
    mla = memory.MLA(heads=A, nope=10, rope=6, value=14, kv_rank=20, q_rank=28)
    shape = memory.LayerShape(hidden_dim=H, num_heads=A, mlp_ratio=FFN / H, parts=(Residual(), mla, DenseMLP(True)),
                              **KW)
    assert shape.part(Attention) is None and shape.part(memory.MLA) == mla
    kept = memory.estimate(H, A, S, B, torch.float32, FFN / H, parts=shape.parts, breakdown=True, **KW)
    t = S * B
    assert kept["qkv"] == t * (28 + A * 16 + 20 + 6 + A * (10 + 14)) * 4 and kept["o"] == t * A * 14 * 4
    plan = memory.plan(shape, B, S, 2 ** 40, num_layers=3, modes=("selective",))
    assert plan.kept_bytes == 3 * sum(kept.values())


def test_with_part_puts_a_part_in_its_roles_place():
    moe = memory.MoE(num_experts=4, top_k=2, expert_dim=16)
    mla = memory.MLA(heads=A, nope=10, rope=6, value=14, kv_rank=20)
    layer = (Residual(), Attention(), DenseMLP(gated=True), Scalars(1), ScaledExpertInput(2))
    assert with_part(layer, moe) == (Residual(), Attention(), moe, Scalars(1), ScaledExpertInput(2))
    assert with_part(layer, mla)[1] == mla and with_part(layer, Scalars(2))[3] == Scalars(3)
    assert with_part((Residual(), DenseMLP(gated=False)), Attention(True)) == (Residual(), Attention(True),
                                                                                DenseMLP(gated=False))


def test_a_whole_layer_that_no_layer_has_is_refused():
    mixer = memory.Mixer("GatedDeltaNet", lambda *args: 1000)
    plain = (Residual(), Attention(), DenseMLP(gated=True))
    cases = [(dict(parts=plain, qk_norm=True), "parts holds a Residual.*qk_norm=True"),
             (dict(parts=(*plain, Attention())), "more than one part of role attention"),
             (dict(parts=(Residual(), Attention(), DenseMLP(gated=False))),
              r"DenseMLP\(gated=False\) with a gated activation"),
             (dict(parts=(*plain[:2], mixer, plain[2])), "mixer 'GatedDeltaNet' with an attention part"),
             (dict(parts=(plain[0], dataclasses.replace(mixer, attention=True), plain[2])), "without an attention"),
             (dict(parts=(plain[0], Attention(True), dataclasses.replace(mixer, attention=True), plain[2])),
              "Attention beside mixer 'GatedDeltaNet'")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            memory.estimate(H, A, S, B, torch.float32, FFN / H, **KW, **kwargs)
    with pytest.raises(ValueError, match="qk_norm must be None, True"):
        Attention("per-token")
    with pytest.raises(ValueError, match="norms must be 2 for a pre-norm layer"):
        Residual("pre-norm", 1)
    with pytest.raises(ValueError, match="more than one part of role mlp"):
        memory.LayerShape(hidden_dim=H, num_heads=A, parts=(Residual(), Attention(), DenseMLP(False), DenseMLP(False)))
