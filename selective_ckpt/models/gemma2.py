"""Hugging Face Gemma2: (1 + w) RMSNorm, GeGLU (tanh GELU), a norm before and after each block (the
"sandwich" residual form: four norms a layer, whose post-norms keep o_proj's and down_proj's outputs),
query_pre_attn_scalar as the attention scale (transformers passes it as `scaling`) and sliding and global
layers alternating (each attention module's own sliding_window). Attention-logit soft-capping
(transformers passes the module's attn_logit_softcapping as `softcap`) runs inside the attention kernels,
the final-logit soft-capping in the fused loss head; bidirectional attention is refused before anything
changes (`check_gemma`)."""

from .errors import ConversionError
from .spec import GATE_UP_CHILDREN, MLPSpec, ModelSpec, NormSpec


def check_gemma(root, name):
    """ConversionError, before any change, for what a Gemma2/Gemma3 config asks that the converted model does
    not reproduce: bidirectional attention. (Attention soft-capping runs in the attention kernels, final-logit
    soft-capping in the fused loss head: models/loss_head.py.)"""
    config = root.config
    if getattr(config, "use_bidirectional_attention", False):
        raise ConversionError(f"{name}: use_bidirectional_attention=True is not supported; selective_ckpt "
                              "attention is causal")
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and 0 < cap < float("inf")):
        raise ConversionError(f"{name}: config.attn_logit_softcapping={cap!r}; the attention kernels soft-cap with a "
                              "finite number > 0 (or None for none)")


def gemma_spec(model_type, prefix, qk_norm=False):
    """The spec of a Gemma2-shaped family: <prefix>DecoderLayer of input_layernorm -> self_attn ->
    post_attention_layernorm, pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm."""
    return ModelSpec(model_types=(model_type,), layer=f"{prefix}DecoderLayer",
                     children=(("input_layernorm", "norm"), ("self_attn", "attention"),
                               ("post_attention_layernorm", "norm"), ("pre_feedforward_layernorm", "norm"),
                               ("post_feedforward_layernorm", "norm"), ("mlp", "mlp")),
                     norm=NormSpec("rmsnorm", f"{prefix}RMSNorm", offset=1.0), attention=f"{prefix}Attention",
                     attention_children=("q_proj", "k_proj", "v_proj", "o_proj"),
                     mlp=MLPSpec(f"{prefix}MLP", "gate_up", GATE_UP_CHILDREN),
                     residual="sandwich", qk_norm=qk_norm, check=check_gemma)


SPEC = gemma_spec("gemma2", "Gemma2")
