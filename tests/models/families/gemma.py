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
