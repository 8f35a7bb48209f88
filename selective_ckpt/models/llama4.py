"""Hugging Face Llama 4 (Llama4ForConditionalGeneration, model type "llama4"): its text model (language_model, a
Llama4ForCausalLM on config.text_config) converts as llama4_text's (models/llama4_text.py), MoE and chunked layers
included; the vision model, the multimodal projector and the composite's own head stay transformers' own
(spec.ModelSpec.text_model), said once at convert."""

import dataclasses

from .llama4_text import SPEC as TEXT

SPEC = dataclasses.replace(TEXT, model_types=("llama4",), text_model="language_model")
