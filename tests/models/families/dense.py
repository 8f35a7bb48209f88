"""Dense families of other layer forms: Phi-3 (packed qkv_proj and gate_up_proj), OLMo2 (post-norms, q/k norms
over the whole projection), SmolLM3 (layers without RoPE, sliding-window layers)."""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)

FAMILIES = [
    Family("phi3", transformers.Phi3Config, transformers.Phi3ForCausalLM, _BASE,
           lora_targets=("qkv_proj", "gate_up_proj", "down_proj"),
           heads=(transformers.Phi3ForSequenceClassification, transformers.Phi3ForTokenClassification)),
    Family("olmo2", transformers.Olmo2Config, transformers.Olmo2ForCausalLM, _BASE,
           heads=(transformers.Olmo2ForSequenceClassification,)),
    # the second layer has no RoPE (no_rope_layers [1, 0]) and a sliding window of 5
    Family("smollm3", transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM,
           {**_BASE, "no_rope_layer_interval": 2, "use_sliding_window": True, "sliding_window": 5},
           heads=(transformers.SmolLM3ForSequenceClassification, transformers.SmolLM3ForTokenClassification)),
]
