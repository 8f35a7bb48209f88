"""Falcon-H1: a Mamba-2 mixer (transformers' own, its torch fallback: no mamba_ssm or causal-conv1d kernels on CPU)
beside the attention in every layer, every multiplier of the config set away from 1 so a dropped one shows.

The shared packed check is not run: transformers' torch fallback of the Mamba-2 scan takes no document boundaries
(no seq_idx reaches it), so the unconverted model's mixer carries state from one document into the next.
"""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

# 4 Mamba heads of 16 (d_ssm 64), state 16, one group, chunks of 8 (the test sequences span several)
FALCON_H1 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, mamba_d_ssm=64, mamba_n_heads=4,
                 mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=8,
                 attention_in_multiplier=0.5, attention_out_multiplier=0.8, ssm_out_multiplier=1.2,
                 ssm_in_multiplier=0.9, key_multiplier=0.7, mlp_multipliers=[0.6, 1.3],
                 ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], embedding_multiplier=2.0, lm_head_multiplier=0.5)

FAMILIES = [
    Family("falcon_h1", transformers.FalconH1Config, transformers.FalconH1ForCausalLM, FALCON_H1, packed=False,
           lora_targets=("q_proj", "v_proj", "in_proj", "down_proj"),  # PEFT refuses out_proj on Mamba
           dropout=dict(attention_dropout=0.17),
           # one kind of layer ("hybrid": attention beside the mixer), whose layer_types the fit's config keeps
           layer_kinds=(("hybrid", {}),)),
]
