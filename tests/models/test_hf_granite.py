"""convert() on Hugging Face Granite, a family added as one model spec file (models/granite.py)."""

import pytest

from tests.models import hf_checks

transformers = pytest.importorskip("transformers")
from transformers import GraniteConfig, GraniteForCausalLM  # noqa: E402


def build(**kw):
    # multipliers away from 1, so each of transformers' own scalings is exercised
    base = dict(vocab_size=hf_checks.VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)
    base.update(kw)
    return lambda: GraniteForCausalLM(GraniteConfig(**base))



def test_modes_bit_identical():
    _, _, ours = hf_checks.triple(build(attention_dropout=0.17))
    ids, mask = hf_checks.batch()
    hf_checks.check_modes_identical(ours, ids, mask)
