"""Gemma 4's text decoder (gemma4_text): Gemma3's sandwich layer with w-scaled float32 norms, q/k/v norms, attention
scaled by 1, sliding and full layers with their own head dims, kv heads and RoPE; its MoE layers (gemma4_text_moe);
and Gemma4ForConditionalGeneration's text model beside its vision tower (gemma4)."""

import dataclasses

import pytest

from tests.models.families import Family
from tests.models.families.composite import CompositeFamily
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
def _gemma4_config(**kw):
    return transformers.Gemma4TextConfig(**_gemma4_kwargs(**kw))


def _gemma4_kwargs(**kw):
    """Gemma4TextConfig keywords whose layers alternate sliding and full attention ending in a full one (transformers
    forces the last layer full), for any layer count; `layer_types` given as a one-kind tuple makes every layer that
    kind. sliding_window=None (the fit's tests: no window) makes every layer full attention: a Gemma 4 sliding layer
    always has a window."""
    n = kw["num_hidden_layers"]
    kinds = kw.pop("layer_types", None)
    if "sliding_window" in kw and kw["sliding_window"] is None:
        del kw["sliding_window"]
        kinds = ("full_attention",)
    if kinds is None:
        kinds = ["full_attention" if (n - 1 - i) % 2 == 0 else "sliding_attention" for i in range(n)]
    return {**kw, "layer_types": [kinds[i % len(kinds)] for i in range(n)]}


# Gemma 4's text decoder: 4 layers, sliding and full alternating (the full ones with proportional RoPE over a
# quarter of the head, theta 1e6); no per-layer input embeddings and no kv sharing (convert refuses both by name);
# a final-logit cap of 5. Head dim 8 (8 heads, 4 kv heads): attention is scaled by 1 over unit-RMS q and k, so the
# scores grow with the head dim, and at 16 the 20-step run amplifies rounding past 1e-4 (transformers' own eager and
# SDPA runs part by 7e-3 there). The estimate is measured on full layers alone: a model holding both kinds computes a
# rope table per kind, which a 2-layer minus 1-layer measure would count as the layer's.
_GEMMA4 = {**_BASE, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
           "global_head_dim": 8, "sliding_window": 5,
           "hidden_size_per_layer_input": 0, "final_logit_softcapping": 5.0}

FAMILIES = [
    Family("gemma4_text", _gemma4_config, transformers.Gemma4ForCausalLM, _GEMMA4,
           dropout={"attention_dropout": 0.17},
           layer_kinds=(("full_attention", {"layer_types": ("full_attention",)}),),
           # full layers with their own head_dim; full layers whose v is k_proj's output (attention_k_eq_v) with
           # their own kv heads
           variants=(("global_head_dim", {"global_head_dim": 16}),
                     ("k_eq_v", {"attention_k_eq_v": True, "num_global_key_value_heads": 1}))),
]

# Gemma 4's MoE layers (enable_moe_block: a dense MLP beside 4 experts, 2 per token, in every layer); transformers'
# "eager" experts loop (its default, grouped_mm, has no float64 kernel for the reference). Packed documents are
# checked by the dense family: here a later document's logits take other bits when the first document's tokens
# route elsewhere, in the unconverted model too (3.6e-7: the experts' matmuls run over other row counts)
_GEMMA4_MOE = {**_GEMMA4, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
               "experts_implementation": "eager"}

FAMILIES += [
    # amplifies_rounding: on the test's data transformers' own eager and SDPA runs part by 1.8e-4 at the last step
    # (4.9e-4 and 2.9e-3 with two other data seeds, where ours parts from SDPA by 6.0e-4 and 2.2e-3 whichever CPU
    # attention kernel runs)
    Family("gemma4_text_moe", _gemma4_config, transformers.Gemma4ForCausalLM, _GEMMA4_MOE, packed=False,
           amplifies_rounding=True,
           dropout={"attention_dropout": 0.17},
           lora_targets=("q_proj", "v_proj", "down_proj"),
           layer_kinds=(("full_attention", {"layer_types": ("full_attention",)}),)),
]


@dataclasses.dataclass(frozen=True)
class _Gemma4Composite(CompositeFamily):
    """Gemma4ForConditionalGeneration around the tiny text config, its layer types as _gemma4_kwargs makes them."""

    def build(self, **kw):
        text = _gemma4_kwargs(**{**self.tiny, **kw})
        return lambda: self.causal_lm(self.config(text_config=text, **dict(self.composite)))


# Gemma 4's vision tower (one layer, 8 x 8 patches pooled 2 x 2) and its embedder beside the dense text model; no
# audio tower. The image tokens are the last ids of the vocabulary.
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                     num_key_value_heads=2, patch_size=8, position_embedding_size=64, pooling_kernel_size=2)

FAMILIES += [
    # LoRA on the text layers by their full names: the vision tower's projections share the names q_proj, k_proj,
    # down_proj but are Gemma4ClippableLinear modules, which PEFT does not adapt. k_proj rather than q_proj: this
    # initialisation's layer-0 q_proj lora_B gradient is 4x SDPA's error (9e-6 relative against 2e-6; at seeds 1-3
    # at most 2.1x); the dense family adapts q_proj
    _Gemma4Composite("gemma4", transformers.Gemma4Config, transformers.Gemma4ForConditionalGeneration, _GEMMA4,
                     lora_targets=tuple(f"language_model.layers.{i}.{p}" for i in range(4)
                                        for p in ("self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")),
                     layer_kinds=(("full_attention", {"layer_types": ("full_attention",)}),),
                     composite=(("vision_config", GEMMA4_VISION), ("audio_config", None),
                                ("image_token_id", VOCAB - 1), ("boi_token_id", VOCAB - 2),
                                ("eoi_token_id", VOCAB - 3)),
                     skip={"fit": "selective_ckpt.fit projects a causal LM built from a text config; a Gemma4Config "
                                  "holds its sizes in text_config and fit refuses it, as Mistral 3's "
                                  "(tests/models/test_hf_composite.py)"}),
]
