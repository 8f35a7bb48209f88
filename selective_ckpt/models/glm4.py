"""Hugging Face GLM-4 (Glm4ForCausalLM: GLM-4-0414, GLM-Z1): a "sandwich" layer with Llama's RMSNorm rounding
(input_layernorm -> self_attn -> post_self_attn_layernorm, post_attention_layernorm -> mlp -> post_mlp_layernorm:
the post-norms keep o_proj's and down_proj's outputs), q/k/v biases by config.attention_bias, and Phi-3's MLP
(one packed gate_up_proj, whose output is all the MLP keeps). RoPE is partial (config partial_rotary_factor, 0.5)
and interleaved: the attention forward is transformers' with its repeated rotary tables made once per model
forward instead of in every layer (models/interleaved_rope.py)."""

from .checks import modules_of
from .interleaved_rope import attention_forward, rotate_glm
from .spec import PACKED_GATE_UP_CHILDREN, MLPSpec, NormSpec, llama_shaped


def _attention_forward(self, *args, **kwargs):
    from transformers.models.glm4 import modeling_glm4

    return attention_forward(self, *args, modeling=modeling_glm4, rotate=rotate_glm, **kwargs)


def _patches(root):
    return [(m, _attention_forward) for _, m in modules_of(root, "Glm4Attention")]


SPEC = llama_shaped("glm4", "Glm4", children=(("input_layernorm", "norm"), ("self_attn", "attention"),
                                              ("post_self_attn_layernorm", "norm"),
                                              ("post_attention_layernorm", "norm"), ("mlp", "mlp"),
                                              ("post_mlp_layernorm", "norm")),
                    norm=NormSpec("rmsnorm", "Glm4RMSNorm"),
                    mlp=MLPSpec("Glm4MLP", "packed_gate_up", PACKED_GATE_UP_CHILDREN), residual="sandwich",
                    patches=_patches)
