"""The Gemma families: (1 + w) RMSNorm and GeGLU (gemma); pre- and post-norms around each block, soft-capping,
query_pre_attn_scalar and alternating sliding / global layers (gemma2); q/k norms and two rope bases
(gemma3_text)."""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)

FAMILIES = [
    Family("gemma", transformers.GemmaConfig, transformers.GemmaForCausalLM, _BASE,
           heads=(transformers.GemmaForSequenceClassification, transformers.GemmaForTokenClassification)),
]

# attention soft-capping off (the converted kernels refuse it), a final-logit cap of 5 (the fused loss head
# applies it; Gemma3's default is none); a window shorter than the sequence. Gemma2's layers
# alternate sliding, global, ... (its default layer_types, so any layer count builds); Gemma3's first five
# are sliding (its default pattern): a model with both kinds computes a second rope table, which a
# 2-layer minus 1-layer measure would count as the layer's (tests/models/test_hf_gemma.py alternates them)
_SANDWICH = {**_BASE, "sliding_window": 5, "query_pre_attn_scalar": 24, "attn_logit_softcapping": None,
             "final_logit_softcapping": None}

FAMILIES += [
    Family("gemma2", transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
           # caps small enough to bend the tiny model's scores and logits (0.1 moves its logits by 3e-3)
           {**_SANDWICH, "attn_logit_softcapping": 0.1, "final_logit_softcapping": 5.0},
           heads=(transformers.Gemma2ForSequenceClassification, transformers.Gemma2ForTokenClassification)),
    Family("gemma3_text", transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
           {**_SANDWICH, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
           heads=(transformers.Gemma3TextForSequenceClassification,)),
]
