"""Families whose decoder layer is Llama's (pre-norm RMSNorm, q/k/v/o attention, gated MLP)."""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)

FAMILIES = [
    Family("llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, _BASE,
           heads=(transformers.LlamaForSequenceClassification, transformers.LlamaForTokenClassification)),
    Family("mistral", transformers.MistralConfig, transformers.MistralForCausalLM, {**_BASE, "sliding_window": 5},
           heads=(transformers.MistralForSequenceClassification, transformers.MistralForTokenClassification),
           window=5),
    # q/k/v biases; sliding-window layers chosen by layer_types
    Family("qwen2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, _BASE,
           heads=(transformers.Qwen2ForSequenceClassification, transformers.Qwen2ForTokenClassification),
           variants=(("sliding-layers", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                             layer_types=["full_attention", "sliding_attention"])),)),
    Family("qwen3", transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {**_BASE, "head_dim": 16},
           heads=(transformers.Qwen3ForSequenceClassification, transformers.Qwen3ForTokenClassification)),
    # multipliers away from 1, so each of transformers' own scalings is exercised
    Family("granite", transformers.GraniteConfig, transformers.GraniteForCausalLM,
           {**_BASE, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
            "logits_scaling": 4.0},
           dropout=dict(attention_dropout=0.17)),
]
