"""What a converted decoder layer is for the memory planner: its LayerShape fields (memory.planner), read from
the model's config and the layer's modules by the model spec's roles."""

from ..activations import kernel_activation


def layer_activation(layer, spec):
    """The LayerShape activation of a converted layer's MLP: what memory.estimate counts for it.

    A gated MLP keeps gate and up whatever its activation ("swiglu" for SiLU, "geglu" for any
    other); a plain one keeps its fc_in output ("gelu_tanh" for tanh-GELU, "gelu" for any other).
    """
    kernel = kernel_activation(getattr(getattr(layer, spec.child("mlp")), spec.mlp.activation))
    if spec.mlp.gated:
        return "swiglu" if kernel == "silu" else "geglu"
    return "gelu_tanh" if kernel == "gelu_tanh" else "gelu"


def config_shape(layer, config, spec):
    """LayerShape fields of a decoder layer from the model's config: hidden_size, num_attention_heads,
    num_key_value_heads, intermediate_size (or GPT-2's n_inner, 4 h by default), the attention's
    head_dim (given only where heads x head_dim is not hidden_size) and sliding_window."""
    attn = getattr(layer, spec.child("attention"))
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(attn, "head_dim", h // heads)
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    kv = getattr(config, "num_key_value_heads", None) or heads
    fields = dict(hidden_dim=h, num_heads=heads, num_kv_heads=kv, ffn_dim=ffn, mlp_ratio=ffn / h, norm=spec.norm.kind,
                  activation=layer_activation(layer, spec),
                  sliding_window=getattr(attn, "sliding_window", None) or None)
    if head_dim * heads != h:
        fields["head_dim"] = head_dim
    if spec.qk_norm:
        fields["qk_norm"] = spec.qk_norm  # the q/k norms keep their inputs and statistics (memory.estimate)
    if spec.residual == "sandwich":
        fields["post_norms"] = True  # the post-norms keep o_proj's and down_proj's outputs and statistics
    return fields


def residual_shape(layer, config, spec, parallel=None):
    """config_shape plus the layer's residual form and norm count for memory.estimate: "parallel" when the
    spec's residual is (or `parallel`, a layer's own flag, says so), norms = the layer's norm children."""
    parallel = spec.residual == "parallel" if parallel is None else parallel
    return {**config_shape(layer, config, spec), "residual": "parallel" if parallel else "pre-norm",
            "norms": spec.count("norm")}
