"""convert() on Hugging Face Qwen2: q/k/v biases, grouped k/v, sliding-window layers by layer_types."""

import pytest

from tests.models.hf_checks import VOCAB, assert_matches_reference, batch, triple

transformers = pytest.importorskip("transformers")
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402


def build(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    base.update(kw)
    return lambda: Qwen2ForCausalLM(Qwen2Config(**base))



def test_sliding_layers():
    ref, plain, ours = triple(build(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                    layer_types=["full_attention", "sliding_attention"]))
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
