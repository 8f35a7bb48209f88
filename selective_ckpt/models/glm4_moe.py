"""Hugging Face GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): Llama-shaped layers with q/k/v biases by
config.attention_bias, partial RoPE (transformers' own attention forward), per-head q/k RMSNorms before RoPE
when config.use_qk_norm, dense Glm4MoeMLP layers before config.first_k_dense_replace and sparse MoE blocks
after it: routed experts plus shared experts behind the sigmoid group-limited router
(models/sigmoid_routed_moe.py)."""

from .hf import config_shape, llama_shaped
from .moe import moe_shape
from .sigmoid_routed_moe import block_fields, is_block, moe_spec


def _shape(layer, config, spec):
    """config_shape (a dense layer) or moe_shape with the block's fields (sigmoid_routed_moe.block_fields); q/k
    norms only where config.use_qk_norm."""
    qk = {"qk_norm": True} if getattr(config, "use_qk_norm", False) else {}
    if not is_block(layer.mlp, "Glm4Moe"):
        fields = config_shape(layer, config, spec)
        fields.pop("qk_norm", None)
        return {**fields, **qk}
    fields = moe_shape(layer, config, spec)
    fields.pop("qk_norm", None)
    return {**fields, **qk, **block_fields(layer.mlp)}


SPEC = llama_shaped("glm4_moe", "Glm4Moe", shape=_shape, qk_norm=True, moe=moe_spec("Glm4Moe", "glm4_moe"))
