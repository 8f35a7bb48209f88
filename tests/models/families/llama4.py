"""Llama 4's text decoder (llama4_text): RoPE layers with a weightless q/k norm and chunked attention, NoPE layers
with the attention temperature, MoE layers (router scaling the transposed experts' input, a shared expert)
interleaved with dense ones; its dense form (llama4_text_dense), whose packed documents are compared bit for bit; and
Llama4ForConditionalGeneration's text model beside its vision model (llama4)."""

import pytest

from tests.models.families import Family
from tests.models.families.composite import CompositeFamily
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

# 4 layers: RoPE (chunked) and NoPE (full, temperature-tuned) alternating, dense and MoE alternating; chunks of 7
# tokens, which the shared checks' 19-, 23- and 24-token sequences do not divide; 4 experts, 2 per token (Llama 4's
# own checkpoints route 1: a variant); the temperature's floor_scale and attn_scale such that the scale grows within
# the test sequences (Llama 4's 8192 and 0.1 leave it 1 below 8191 tokens)
LLAMA4 = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=32, intermediate_size_mlp=80, num_local_experts=4, num_experts_per_tok=2,
              interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=7, floor_scale=4,
              attn_scale=0.5, max_position_embeddings=64, pad_token_id=0)
# each kind of layer in a model of that kind alone (an interval or step past the layer count: none of that kind)
_KINDS = (("rope dense", {"no_rope_layer_interval": 64, "interleave_moe_layer_step": 64}),
          ("rope moe", {"no_rope_layer_interval": 64, "interleave_moe_layer_step": 1}),
          ("nope dense", {"no_rope_layer_interval": 1, "interleave_moe_layer_step": 64}),
          ("nope moe", {"no_rope_layer_interval": 1, "interleave_moe_layer_step": 1}))
_VARIANTS = (("top-1", {"num_experts_per_tok": 1}), ("no qk norm", {"use_qk_norm": False}),
             ("no temperature", {"attn_temperature_tuning": False}), ("chunk past the sequence",
                                                                       {"attention_chunk_size": 32}),
             ("attention bias", {"attention_bias": True}))
# attention dropout with no chunked layer (convert refuses it with chunked ones)
_DROPOUT = {"attention_dropout": 0.17, "attention_chunk_size": None}

# transformers' Llama 4 experts run every token through every expert (torch.bmm, zero rows for the unrouted ones)
_MATMULS = ("transformers' Llama 4 experts run every token through every expert; the converted block runs each "
            "token's top-k: fewer matmul FLOPs (tests/models/test_hf_llama4.py counts them)")

FAMILIES = [
    # packed documents: the MoE family's later documents take other bits when the first one's tokens route elsewhere
    # (the experts' matmuls run over other row counts); llama4_text_dense compares them bit for bit
    Family("llama4_text", transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, LLAMA4, packed=False,
           lora_targets=("q_proj", "v_proj", "o_proj"), layer_kinds=_KINDS, variants=_VARIANTS, dropout=_DROPOUT,
           skip={"matmuls": _MATMULS}),
    Family("llama4_text_dense", transformers.Llama4TextConfig, transformers.Llama4ForCausalLM,
           {**LLAMA4, "interleave_moe_layer_step": 64}, layer_kinds=_KINDS[::2], dropout=_DROPOUT),
]

# a one-layer vision model on 16 x 16 images of 8 x 8 patches; the image tokens the last ids of the vocabulary
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
               patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)

FAMILIES += [
    CompositeFamily("llama4", transformers.Llama4Config, transformers.Llama4ForConditionalGeneration, LLAMA4,
                    packed=False, lora_targets=tuple(f"language_model.model.layers.{i}.self_attn.{p}" for i in range(4)
                                                     for p in ("q_proj", "v_proj")),
                    layer_kinds=_KINDS[:1],
                    composite=(("vision_config", _VISION), ("image_token_index", VOCAB - 1),
                               ("boi_token_index", VOCAB - 2), ("eoi_token_index", VOCAB - 3)),
                    skip={"matmuls": _MATMULS,
                          "fit": "selective_ckpt.fit projects a causal LM built from a text config; a Llama4Config "
                                 "holds its sizes in text_config and fit refuses it, as Mistral 3's"}),
]
