"""Hugging Face GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): Llama-shaped layers with q/k/v biases by
config.attention_bias, partial RoPE (transformers' own attention forward), per-head q/k RMSNorms before RoPE
when config.use_qk_norm, dense Glm4MoeMLP layers before config.first_k_dense_replace and sparse MoE blocks
after it: routed experts plus shared experts behind the sigmoid group-limited router
(models/sigmoid_routed_moe.py)."""

from .sigmoid_routed_moe import moe_spec
from .spec import llama_shaped

# q/k norms only where config.use_qk_norm
SPEC = llama_shaped("glm4_moe", "Glm4Moe", qk_norm=True, attention_optional=("q_norm", "k_norm"),
                    moe=moe_spec("Glm4Moe", "glm4_moe"))
