"""Hugging Face Gemma 4 text models (Gemma4ForCausalLM on Gemma4TextConfig, model type "gemma4_text"): Gemma3's
sandwich layer (four norms a layer, the post-norms keeping o_proj's and down_proj's outputs) with:

- Gemma4RMSNorm: T(x * rstd * w) in float32, rounded once, its weight used as it is (no (1 + w)), and scale-free
  norms (v_norm, the router's) without a weight: every one of them runs its own forward, bit for bit, keeping its
  input only and running again in backward (spec.NormSpec rounding "float32_scale");
- per-head RMSNorms on q and k before RoPE and a scale-free one on v (qk_norm=True with v_norm as a third child):
  each keeps its input (the projection's output); v_norm's output, attention's v, is rebuilt from it. Where
  attention_k_eq_v makes a full layer's v from k_proj (no v_proj), v_norm reads k_norm's input, kept once;
- attention scaled by 1 (transformers passes `scaling=1.0`), sliding and full layers by config.layer_types, each
  with its own head_dim (full layers: global_head_dim), kv heads (num_global_key_value_heads with k_eq_v) and rope
  (the full layers' proportional RoPE): the rotary tables are transformers' own, the attention module's forward
  applies them, so any table runs as it does unconverted;
- the final-logit soft-capping in the fused loss head; the layer's layer_scalar buffer multiplied in as
  transformers does (a product by a buffer keeps nothing new);
- the MoE layers (enable_moe_block): a dense gated MLP beside routed experts (models/moe.py's RoutedExperts, each
  routed row keeping its gate and up outputs), the router transformers' own, each branch with its own post-norm.

Refused by name before anything changes (check_gemma4): per-layer input embeddings (hidden_size_per_layer_input > 0),
layers sharing another layer's keys and values (num_kv_shared_layers > 0), bidirectional attention over all tokens
(use_bidirectional_attention="all"; "vision" keeps the text model causal)."""

import dataclasses

import torch

from ..keeping import pipeline
from ..memory.estimate import MoE
from ..memory.parts import Scalars
from .attention import forward_with_rope
from .checks import check_children, modules_of
from .errors import ConversionError
from .layer_shape import config_shape, with_parts
from .moe import check_experts, experts_forward
from .patching import PATCHED
from .spec import GATE_UP_CHILDREN, MLPSpec, ModelSpec, NormSpec

# a MoE layer's own children (config.enable_moe_block: every layer holds them)
_MOE_CHILDREN = (("router", "own"), ("experts", "own"), ("post_feedforward_layernorm_1", "norm"),
                 ("post_feedforward_layernorm_2", "norm"), ("pre_feedforward_layernorm_2", "norm"))
_LAYER_CHILDREN = (("input_layernorm", "norm"), ("self_attn", "attention"), ("post_attention_layernorm", "norm"),
                   ("pre_feedforward_layernorm", "norm"), ("post_feedforward_layernorm", "norm"),
                   ("mlp", "mlp")) + _MOE_CHILDREN


def check_gemma4(root, name):
    """ConversionError, before any change, for what a Gemma 4 text config asks that the converted model does not
    reproduce at the floor."""
    config = root.config
    # "vision": the text model stays causal; a composite model's mask over image tokens, which our kernels do not
    # express, runs transformers' SDPA attention for that call (models/attention.py)
    if getattr(config, "use_bidirectional_attention", None) not in (None, "vision"):
        raise ConversionError(f"{name}: use_bidirectional_attention={config.use_bidirectional_attention!r} is not "
                              "supported; selective_ckpt attention is causal")
    if getattr(config, "hidden_size_per_layer_input", 0):
        raise ConversionError(f"{name}: hidden_size_per_layer_input={config.hidden_size_per_layer_input} (per-layer "
                              "input embeddings, a third residual block per layer) cannot be converted; "
                              "selective_ckpt converts Gemma 4 text models with hidden_size_per_layer_input=0")
    if getattr(config, "num_kv_shared_layers", 0):
        raise ConversionError(f"{name}: num_kv_shared_layers={config.num_kv_shared_layers} (layers reading another "
                              "layer's keys and values) cannot be converted; selective_ckpt converts Gemma 4 text "
                              "models with num_kv_shared_layers=0")
    for lname, layer in modules_of(root, "Gemma4TextDecoderLayer"):
        held = [c for c, _ in _MOE_CHILDREN if c in layer._modules]
        if not held:
            continue
        if len(held) != len(_MOE_CHILDREN):
            raise ConversionError(f"{lname}: a MoE layer holds {held} of {[c for c, _ in _MOE_CHILDREN]}; it cannot be "
                                  "converted")
        router, experts = layer.router, layer.experts
        if type(router).__name__ != "Gemma4TextRouter" or type(experts).__name__ != "Gemma4TextExperts":
            raise ConversionError(f"{lname}: router {type(router).__name__} and experts {type(experts).__name__} must "
                                  "be Gemma4TextRouter and Gemma4TextExperts")
        check_children(router, f"{lname}.router", ("norm", "proj"), "gemma4_text")
        check_children(experts, f"{lname}.experts", ("act_fn",), "gemma4_text")
        check_experts(experts, f"{lname}.experts")


# --- RoPE on the normed q and k, rebuilt. Gemma 4 rotates q and k one at a time (apply_rotary_pos_emb(x, cos, sin,
# unsqueeze_dim)) on [B, S, heads, D] before transposing them; the norms' outputs it reads are rebuilt, so its
# outputs, which attention keeps, are rebuilt too, by the same function on the same bits. A layer then keeps its
# projections' outputs (the norms' inputs) for q, k and v, as a Llama layer keeps q, k and v.

def _rebuilt_rope(rope):
    def rotate(x, *args, **kwargs):
        out = rope(x, *args, **kwargs)
        if pipeline.active():
            src = pipeline.source(x)
            if src is not x:  # a rebuilt norm's output (or a view of one)
                pipeline.discardable(out, _with_kwargs, rope, kwargs, src, *args)
        return out

    return rotate


def _with_kwargs(rope, kwargs, x, *args):
    return rope(x, *args, **kwargs)


def _forward_of(cls):
    """cls.forward as transformers defines it, apply_rotary_pos_emb replaced by _rebuilt_rope's."""
    return forward_with_rope(cls, _rebuilt_rope)


def attention_forward(self, *args, **kwargs):
    """Gemma4TextAttention's own forward, RoPE's outputs rebuilt in backward from the q/k norms' (rebuilt) outputs."""
    if torch.compiler.is_compiling():  # no pipeline while dynamo traces (the compiled graph decides what it keeps)
        return getattr(self, PATCHED)(*args, **kwargs)
    if "past_key_values" in kwargs and "cache" not in kwargs:  # the name its deprecation wrapper still takes
        kwargs["cache"] = kwargs.pop("past_key_values")
    return _forward_of(type(self))(self, *args, **kwargs)


def _patches(root):
    out = [(m, experts_forward) for _, m in modules_of(root, "Gemma4TextExperts")]
    for name, module in modules_of(root, "Gemma4TextAttention"):
        try:
            _forward_of(type(module))
        except ConversionError as e:
            raise ConversionError(f"{name}: {e}") from None
        out.append((module, attention_forward))
    return out


@dataclasses.dataclass(frozen=True)
class Gemma4MoE(MoE):
    """A Gemma 4 MoE layer's experts for memory.estimate: memory.MoE's routed rows and router (softmax over all
    experts, top-k, normalised in place) with the dense MLP beside them as an ungated "shared expert" (its gate and
    up kept), and what Gemma 4's own router and sums keep besides: the router projection's input (the scaled norm
    output, t*h), the per-expert scale's product (both fp32 operands, t*k each), the experts' output and the sum of
    the two branches (the inputs of their post-norms, t*h each; the dense branch's is memory.estimate's mlp_out)."""

    hidden_dim: int = 0

    def kept(self, tokens, mlp_size, size, recompute="selective"):
        parts = super().kept(tokens, mlp_size, size, recompute)
        t, h = tokens, self.hidden_dim
        parts.update(router_in=t * h * size, expert_scale=2 * t * self.top_k * 4, experts_out=t * h * size,
                     branch_sum=t * h * size)
        return parts


def _shape(layer, config, spec):
    """config_shape with the layer's own kv heads (a full layer's num_global_key_value_heads); a MoE layer (by
    config.enable_moe_block) adds its experts and router (Gemma4MoE)."""
    attn = getattr(layer, spec.child("attention"))
    fields = config_shape(layer, config, spec)
    fields["num_kv_heads"] = attn.k_proj.out_features // attn.head_dim
    if "experts" in layer._modules:
        experts, dense = layer.experts, getattr(layer.mlp.gate_proj, "base_layer", layer.mlp.gate_proj)
        moe = Gemma4MoE(num_experts=experts.num_experts, top_k=config.top_k_experts,
                        expert_dim=experts.intermediate_dim, weights_dtype=torch.float32,
                        shared_dim=dense.out_features, shared_gate=False, hidden_dim=config.hidden_size)
        fields = with_parts(fields, moe, Scalars(1))  # the router's input times hidden_size ** -0.5, a Python float
    return fields


SPEC = ModelSpec(model_types=("gemma4_text",), layer="Gemma4TextDecoderLayer", children=_LAYER_CHILDREN,
                 norm=NormSpec("rmsnorm", "Gemma4RMSNorm", rounding="float32_scale"), attention="Gemma4TextAttention",
                 attention_children=("q_proj", "k_proj", "v_proj", "o_proj"),
                 mlp=MLPSpec("Gemma4TextMLP", "gate_up", GATE_UP_CHILDREN), shape=_shape, residual="sandwich",
                 qk_norm=True, qk_norm_children=("q_norm", "k_norm", "v_norm"), check=check_gemma4,
                 attention_optional=("v_proj",), patches=_patches, optional=tuple(c for c, _ in _MOE_CHILDREN))
