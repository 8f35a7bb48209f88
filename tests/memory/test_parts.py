"""memory/parts.py: a layer's parts, each entering what it keeps; estimate sums them, so a new form is a new part
handed in `parts` (and LayerShape.parts), not a new keyword. Counted by hand against the floor's formulas."""

import dataclasses

import pytest
import torch

from selective_ckpt import memory
from selective_ckpt.memory.estimate import layer_parts
from selective_ckpt.memory.parts import Attention, DenseMLP, Residual, Scalars


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
    assert wider.layer_parts()[-1] == ScaledExpertInput(top_k=3)
    assert [type(p) for p in shape.layer_parts()] == [Residual, Attention, DenseMLP]
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
