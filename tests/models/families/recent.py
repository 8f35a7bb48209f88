"""Families released in the last year: OLMo 3 (OLMo2's post-norm layer with sliding-window layers), Ministral
(Llama-shaped, sliding layers by layer_types), EXAONE 4.0 (post-norms, per-head q/k norms, sliding layers),
Seed-OSS (biases, functional residual dropouts) and Apertus (per-head q/k norms, a plain xIELU MLP)."""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

# classifier_dropout 0: the token-classification heads drop out their hidden states (0.1 by default), and the
# train-mode comparison of the three models would otherwise hold three different masks
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, classifier_dropout=0.0)

FAMILIES = [
    # both layers sliding (OLMo 3's default pattern: every fourth layer is global), a window shorter than the sequence
    Family("olmo3", transformers.Olmo3Config, transformers.Olmo3ForCausalLM, {**_BASE, "sliding_window": 5},
           heads=(transformers.Olmo3ForSequenceClassification,)),
    Family("ministral", transformers.MinistralConfig, transformers.MinistralForCausalLM,
           {**_BASE, "head_dim": 16, "sliding_window": 5},
           heads=(transformers.MinistralForSequenceClassification, transformers.MinistralForTokenClassification)),
    # both layers sliding (its default pattern: every fourth layer global, which with a window runs without RoPE
    # and is refused: selective_ckpt/models/exaone4.py)
    Family("exaone4", transformers.Exaone4Config, transformers.Exaone4ForCausalLM,
           {**_BASE, "head_dim": 16, "sliding_window": 5},
           heads=(transformers.Exaone4ForSequenceClassification, transformers.Exaone4ForTokenClassification)),
    # its residual and attention dropouts (0.1 by default) off: the checks compare train-mode steps
    Family("seed_oss", transformers.SeedOssConfig, transformers.SeedOssForCausalLM,
           {**_BASE, "head_dim": 16, "attention_dropout": 0.0, "residual_dropout": 0.0},
           heads=(transformers.SeedOssForSequenceClassification, transformers.SeedOssForTokenClassification)),
    # its default xIELU activation; llama3 RoPE scaled to the tiny model's positions (its frequencies between the
    # low and high bands are interpolated)
    Family("apertus", transformers.ApertusConfig, transformers.ApertusForCausalLM,
           {**_BASE, "head_dim": 16, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                         "original_max_position_embeddings": 32,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
           lora_targets=("q_proj", "v_proj", "up_proj"), heads=(transformers.ApertusForTokenClassification,)),
]
