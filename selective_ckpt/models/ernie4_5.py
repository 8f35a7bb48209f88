"""Hugging Face ERNIE 4.5 dense (Ernie4_5ForCausalLM): Llama-shaped, with biases on every projection by
config.use_bias and an interleaved RoPE computed in float32: the attention forward is transformers' with its
repeated rotary tables made once per model forward instead of in every layer (models/interleaved_rope.py)."""

from .checks import modules_of
from .interleaved_rope import attention_forward, rotate_ernie
from .spec import llama_shaped


def _attention_forward(self, *args, **kwargs):
    from transformers.models.ernie4_5 import modeling_ernie4_5

    return attention_forward(self, *args, modeling=modeling_ernie4_5, rotate=rotate_ernie, **kwargs)


def _patches(root):
    return [(m, _attention_forward) for _, m in modules_of(root, "Ernie4_5Attention")]


SPEC = llama_shaped("ernie4_5", "Ernie4_5", patches=_patches)
