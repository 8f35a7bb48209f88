"""Families people fine-tune now: GLM-4 (sandwich norms, packed gate_up MLP, partial interleaved RoPE), Hunyuan dense
(per-head q/k norms after RoPE, NTK-alpha RoPE), ERNIE 4.5 (Llama-shaped with biases, float32 interleaved RoPE)."""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

# classifier_dropout 0: the token-classification heads drop out their hidden states (0.1 by default), and the
# train-mode comparison of the three models would otherwise hold three different masks
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, classifier_dropout=0.0)

FAMILIES = [
    # its defaults: q/k/v biases, RoPE over half of each head (partial_rotary_factor 0.5), interleaved
    Family("glm4", transformers.Glm4Config, transformers.Glm4ForCausalLM, _BASE,
           lora_targets=("q_proj", "v_proj", "gate_up_proj", "down_proj"), dropout=dict(attention_dropout=0.17),
           heads=(transformers.Glm4ForSequenceClassification, transformers.Glm4ForTokenClassification)),
    # the released checkpoints' RoPE: "dynamic" with a fixed alpha, which transformers runs as static NTK-alpha
    Family("hunyuan_v1_dense", transformers.HunYuanDenseV1Config, transformers.HunYuanDenseV1ForCausalLM,
           {**_BASE, "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0,
                                         "factor": 1.0}},
           heads=(transformers.HunYuanDenseV1ForSequenceClassification,)),
    # biases on every projection (use_bias; off in the released checkpoints, which the Llama path covers)
    Family("ernie4_5", transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM, {**_BASE, "use_bias": True}),
]
