"""Hugging Face DeepSeek-V3 (DeepseekV3ForCausalLM): Llama-shaped norms and residuals around multi-head latent
attention (models/mla.py: q and kv low-rank projections with their RMSNorms, decoupled RoPE, a value head narrower
than the query's; what it keeps: docs/kernels/mla.md), dense DeepseekV3MLP layers before
config.first_k_dense_replace and sparse MoE blocks after it: routed experts plus shared experts behind the sigmoid
group-limited router (models/sigmoid_routed_moe.py)."""

from ..memory.latent_attention import MLA
from .checks import modules_of
from .layer_shape import config_shape, with_parts
from .mla import check_attention, mla_forward
from .sigmoid_routed_moe import moe_spec
from .spec import llama_shaped

_ATTENTION = "DeepseekV3Attention"


def _check(root, name):
    for aname, module in modules_of(root, _ATTENTION):
        check_attention(module, f"{name}.{aname}")


def _patches(root):
    return [(m, mla_forward) for _, m in modules_of(root, _ATTENTION)]


def _shape(layer, config, spec):
    """config_shape with the layer's memory.MLA in place of its attention (its widths are the config's)."""
    attn = layer.self_attn
    mla = MLA(heads=config.num_attention_heads, nope=attn.qk_nope_head_dim, rope=attn.qk_rope_head_dim,
              value=attn.v_head_dim, kv_rank=attn.kv_lora_rank, q_rank=attn.q_lora_rank)
    return with_parts(config_shape(layer, config, spec), mla)


SPEC = llama_shaped("deepseek_v3", "DeepseekV3", shape=_shape, check=_check, patches=_patches,
                    attention_children=("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                        "kv_a_layernorm", "kv_b_proj", "o_proj"),
                    # one q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj by config.q_lora_rank
                    attention_optional=("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj"),
                    moe=moe_spec("DeepseekV3", "deepseek_v3"))
