"""Hugging Face Gemma 4 (Gemma4ForConditionalGeneration, model type "gemma4"): its text model (model.language_model,
a Gemma4TextModel on config.text_config) converts as gemma4_text's (models/gemma4_text.py), MoE layers included; the
vision and audio towers, their embedders and lm_head stay transformers' own (spec.ModelSpec.text_model), said once at
convert."""

import dataclasses

from .gemma4_text import SPEC as TEXT

SPEC = dataclasses.replace(TEXT, model_types=("gemma4",), text_model="model.language_model")
