"""Composite (vision and text) models whose text decoder converts (hf.ModelSpec.text_model): Mistral 3
(Mistral3ForConditionalGeneration: a Pixtral vision tower and a projector, left as they are, around a Mistral text
model). `tiny` is the text config's keyword arguments; build() puts its keywords into the text config, so the
shared checks' num_hidden_layers=n builds n text layers."""

import dataclasses

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")


@dataclasses.dataclass(frozen=True)
class CompositeFamily(Family):
    composite: tuple = ()  # ((keyword, value), ...) of the composite config beside text_config

    def build(self, **kw):
        return lambda: self.causal_lm(self.config(text_config={**self.tiny, **kw}, **dict(self.composite)))


# a one-layer Pixtral tower on 32 x 32 images of 8 x 8 patches; the image token the last of the vocabulary
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
               image_size=32, patch_size=8)

FAMILIES = [
    # no classification heads: transformers has none for Mistral 3. Its lm_head and loss stay transformers' own
    # (the fused loss head is a *ForCausalLM's), which the shared checks compare like any other. With its attention
    # dropout on, the recompute modes and transformers' checkpointing switched on the composite give the same bits.
    CompositeFamily("mistral3", transformers.Mistral3Config, transformers.Mistral3ForConditionalGeneration,
                    dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         pad_token_id=0),
                    dropout={"attention_dropout": 0.17},
                    composite=(("vision_config", _VISION), ("image_token_index", VOCAB - 1),
                               ("spatial_merge_size", 2)),
                    skip={"fit": "selective_ckpt.fit projects a causal LM built from a text config "
                                 "(AutoModelForCausalLM); a Mistral3Config holds its sizes in text_config and fit "
                                 "refuses it (ValueError), so there is no prediction to hold against a measured step "
                                 "(tests/models/test_hf_composite.py checks the refusal)"}),
]
