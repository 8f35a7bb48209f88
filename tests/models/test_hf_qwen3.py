"""convert() on Hugging Face Qwen3: q_norm / k_norm (RMSNorm per head) patched like the layer norms."""

import pytest

from tests.models import hf_checks

transformers = pytest.importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402


def build(**kw):
    base = dict(vocab_size=hf_checks.VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
    base.update(kw)
    return lambda: Qwen3ForCausalLM(Qwen3Config(**base))

