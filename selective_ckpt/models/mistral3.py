"""Hugging Face Mistral 3 (Mistral Small 3.1 / 3.2, Mistral3ForConditionalGeneration, model type "mistral3"): its
text model (model.language_model, a MistralModel on config.text_config) converts as Mistral's; the Pixtral vision
tower, the multimodal projector and lm_head stay transformers' own (spec.ModelSpec.text_model), said once at convert.
"""

import dataclasses

from .mistral import SPEC as MISTRAL

SPEC = dataclasses.replace(MISTRAL, model_types=("mistral3",), text_model="model.language_model")
