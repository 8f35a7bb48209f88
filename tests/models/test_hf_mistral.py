"""convert() on Hugging Face Mistral: grouped k/v and a sliding window shorter than the sequence."""

import pytest

from tests.models.hf_checks import VOCAB, check_window_applied

transformers = pytest.importorskip("transformers")
from transformers import MistralConfig, MistralForCausalLM  # noqa: E402


def build(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, sliding_window=5, pad_token_id=0)
    base.update(kw)
    return lambda: MistralForCausalLM(MistralConfig(**base))


def test_window_is_applied():
    """Tokens further back than the window reach a query only through earlier layers, never directly."""
    check_window_applied(build(num_hidden_layers=1))
