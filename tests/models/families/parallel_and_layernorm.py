"""Families with LayerNorms and GELU or parallel residuals: Starcoder2 (LayerNorm with bias, c_fc/c_proj GELU
MLP, sliding window), Cohere (one bias-free LayerNorm feeding attention and MLP in parallel, logit scale) and
GPT-NeoX (packed query_key_value, partial rotary; parallel residual with two norms, and sequential)."""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, pad_token_id=0)
_NEOX = {**_BASE, "rotary_pct": 0.5, "bos_token_id": 1, "eos_token_id": 2}
_NEOX_HEADS = (transformers.GPTNeoXForSequenceClassification, transformers.GPTNeoXForTokenClassification)

FAMILIES = [
    Family("starcoder2", transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM,
           {**_BASE, "num_key_value_heads": 2, "sliding_window": 5, "bos_token_id": 1, "eos_token_id": 2},
           lora_targets=("q_proj", "v_proj", "c_proj"),
           heads=(transformers.Starcoder2ForSequenceClassification, transformers.Starcoder2ForTokenClassification)),
    # a logit scale away from Cohere's 0.0625 default, so the loss head's folded scale is exercised
    Family("cohere", transformers.CohereConfig, transformers.CohereForCausalLM,
           {**_BASE, "num_key_value_heads": 2, "logit_scale": 0.5, "bos_token_id": 1, "eos_token_id": 2},
           lora_targets=("q_proj", "v_proj", "down_proj")),
    Family("gpt_neox", transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, _NEOX,
           lora_targets=("query_key_value", "dense_4h_to_h"), heads=_NEOX_HEADS),
]


class _Sequential(Family):
    def __str__(self):
        return "gpt_neox-sequential"


FAMILIES.append(_Sequential("gpt_neox", transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                            {**_NEOX, "use_parallel_residual": False}, lora_targets=("query_key_value", "dense"),
                            heads=_NEOX_HEADS))
