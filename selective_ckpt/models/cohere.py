"""Hugging Face Cohere: one CohereLayerNorm (no bias) feeding attention and the gated MLP in parallel
(x + attn(norm(x)) + mlp(norm(x)): the layer keeps x and one norm's statistics, no x1), attention through the
registry; its interleaved RoPE and the logit scale stay in transformers' own forwards (the loss head folds
the scale into the hidden states it reads).

Per-head q/k norms (use_qk_norm: a LayerNorm over [heads, head_dim] with a weight per head) are refused.
"""

from .errors import ConversionError
from .spec import GATE_UP_CHILDREN, MLPSpec, ModelSpec, NormSpec


def _check(root, name):
    if getattr(root.config, "use_qk_norm", False):
        raise ConversionError(f"{name}: use_qk_norm=True (CohereLayerNorm over [heads, head_dim] with a weight per "
                              "head on q and k) cannot be converted")


SPEC = ModelSpec(
    model_types=("cohere",), layer="CohereDecoderLayer",
    children=(("input_layernorm", "norm"), ("self_attn", "attention"), ("mlp", "mlp")),
    norm=NormSpec("layernorm", "CohereLayerNorm"), attention="CohereAttention",
    attention_children=("q_proj", "k_proj", "v_proj", "o_proj"),
    mlp=MLPSpec("CohereMLP", "gate_up", GATE_UP_CHILDREN),
    residual="parallel", check=_check)
