"""Hugging Face Llama 4 text models (Llama4ForCausalLM on Llama4TextConfig, model type "llama4_text"): Llama-shaped
layers whose MLP child is `feed_forward`, with:

- RoPE layers and NoPE layers (config.no_rope_layers: 1 rotates q and k, 0 does not). RoPE rotates pairs of q and k
  in float32 by transformers' own complex tables (its attention forward runs as it is); on RoPE layers with
  use_qk_norm one weightless RMSNorm (Llama4TextWeightlessRMSNorm, alias Llama4TextL2Norm) normalises the rotated q
  and k per head: it keeps its input and fp32 statistics (and a row of ones, its kernel weight), attention reads its
  output, rebuilt (spec.ModelSpec qk_norm="rotated");
- attention temperature tuning on NoPE layers (attn_temperature_tuning: q times 1 + attn_scale *
  log1p(floor((position + 1) / floor_scale)) per position), computed by transformers' forward as it is: attention
  keeps the scaled q instead of q (the same bytes) and the product keeps the float32 scales (seq_len * 4 bytes);
- chunked attention on the layers config.layer_types names "chunked_attention" (the RoPE layers when
  attention_chunk_size is set): a window per chunk of attention_chunk_size tokens, run by the kernels as packed
  segments (models/chunked_attention.py); attention dropout with chunked layers is refused by name;
- dense layers (Llama4TextMLP, activation child `activation_fn`, width intermediate_size_mlp) and MoE layers where
  config.moe_layers (or interleave_moe_layer_step) puts them: Llama4TextMoe of transformers' router (a Linear, top-k
  of the logits, sigmoid of those k), routed experts stored transposed (gate_up_proj [E, hidden, 2*inter], gate
  then up; down_proj [E, inter, hidden]) whose input the router's score scales (not their output), and a shared
  expert (a Llama4TextMLP) added to them. The experts run through models/moe.py's RoutedExperts with scale_input:
  each routed row keeps its gate and up outputs; the scaled input, the product and the down output are rebuilt.
  transformers runs every token through every expert (the unrouted ones on zero rows, which add nothing); the
  converted block runs each token's top-k experts only.
"""

import dataclasses

import torch

from ..activations import kernel_activation
from ..memory.estimate import MoE
from ..memory.parts import Attention
from ..storages import PLAIN_TENSOR_TYPES
from . import chunked_attention
from .checks import check_activation, check_children, is_class, modules_of
from .errors import ConversionError
from .layer_parts import MLPPart
from .layer_shape import config_shape, with_parts
from .moe import MoESpec, RoutedExperts, _in_tiles, _records, compute_dtype
from .patches import mlp_tiles, tiled_forward, weightless_rms_norm_forward
from .spec import GATE_UP_ACTIVATION_FN_CHILDREN, MLPSpec, ModelSpec, NormSpec

_BLOCK, _EXPERTS, _ROUTER, _MLP = "Llama4TextMoe", "Llama4TextExperts", "Llama4Router", "Llama4TextMLP"
_QK_NORM = "Llama4TextWeightlessRMSNorm"


def check_llama4(root, name):
    """ConversionError, before any change, for what a Llama 4 text config asks that the converted model does not
    reproduce."""
    chunked_attention.check_config(root.config, name)


def experts_forward(self, hidden_states, index=None, weights=None):
    """Llama4TextExperts: transformers' own forward for its one argument (every expert on its pre-scaled rows);
    called by the converted block with each token's top-k experts and router scores, the experts of those k only,
    the scores scaling their input (RoutedExperts with scale_input), keeping each routed row's gate and up."""
    if index is None:
        return type(self).forward(self, hidden_states)
    dtype = compute_dtype(self, hidden_states)
    with torch.autocast(hidden_states.device.type, enabled=False):
        # transposed [E, hidden, 2*inter] and [E, inter, hidden]: RoutedExperts takes [E, 2*inter, hidden] and
        # [E, hidden, inter], views of them
        return RoutedExperts.apply(hidden_states, self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2),
                                   weights, index, kernel_activation(self.act_fn), "sum", dtype, True)


class _Picked(torch.autograd.Function):
    """scores.gather(1, index), keeping the index only: torch's gather keeps the scores too, a [t, E] copy where the
    router rounds them to a 16-bit dtype (its fp32 sigmoid output is kept anyway)."""

    @staticmethod
    def forward(ctx, scores, index):
        ctx.shape = scores.shape
        ctx.save_for_backward(index)
        return scores.gather(1, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter_(1, index, grad), None


def _rows(block, x):
    """(the block's output rows, the router logits) for rows x [n, h]: the shared expert plus the routed experts,
    added in place as Llama4TextMoe adds them."""
    scores, logits = block.router(x)
    index = torch.topk(logits.detach(), block.router.top_k, dim=1).indices  # the router's own choice
    routed = block.experts(x, index, _Picked.apply(scores, index))
    out = block.shared_expert(x)
    out.add_(routed)
    return out, logits


@tiled_forward
def block_forward(self, hidden_states):
    """Llama4TextMoe: transformers' own forward where autograd records nothing; else the routed experts of each
    token's top-k (experts_forward) plus the shared expert, over sequence tiles with the layer's mlp_tiles > 1."""
    if not _records(self, hidden_states):
        return type(self).forward(self, hidden_states)
    if mlp_tiles(self) > 1:
        return _in_tiles(self, hidden_states, lambda block, x: _rows(block, x)[0]), None
    return _rows(self, hidden_states.reshape(-1, self.hidden_dim))


class Llama4MoESpec(MoESpec):
    """MoESpec for Llama4TextMoe: its router is `router`, its experts transposed (gate then up along the last dim),
    with a shared expert of the dense MLP's class."""

    def check_block(self, block, name, model_type, mlp_cls):
        check_children(block, name, self.children, model_type)
        check_children(block.experts, f"{name}.experts", ("act_fn",), model_type)
        check_children(block.router, f"{name}.router", (), model_type)
        if not all(is_class(m, c) for m, c in ((block.experts, _EXPERTS), (block.router, _ROUTER),
                                                (block.shared_expert, _MLP))):
            held = ", ".join(type(m).__name__ for m in (block.experts, block.router, block.shared_expert))
            raise ConversionError(f"{name} (model type {model_type!r}): experts, router and shared expert are {held}; "
                                  f"they must be {_EXPERTS}, {_ROUTER} and {_MLP}")
        check_children(block.shared_expert, f"{name}.shared_expert", GATE_UP_ACTIVATION_FN_CHILDREN, model_type)
        check_activation(block.shared_expert, f"{name}.shared_expert", model_type, SPEC.mlp.activation)
        experts = block.experts
        for p in ("gate_up_proj", "down_proj"):
            t = getattr(experts, p, None)
            if not isinstance(t, torch.nn.Parameter) or type(t) not in PLAIN_TENSOR_TYPES:
                raise ConversionError(f"{name}.experts.{p} is not a plain nn.Parameter; it cannot be converted")
        if kernel_activation(experts.act_fn) is None:
            raise ConversionError(f"{name}.experts.act_fn ({type(experts.act_fn).__name__}) is not an activation "
                                  "selective_ckpt rebuilds inside the experts (silu, gelu, gelu_tanh without hooks of "
                                  "their own)")
        if block.router.weight.shape[0] != experts.num_experts or block.router.bias is not None:
            raise ConversionError(f"{name}.router is not a bias-free router over the block's {experts.num_experts} "
                                  "experts")

    def patches(self, root):
        return ([(m, experts_forward) for _, m in modules_of(root, self.experts)] +
                [(m, block_forward) for _, m in modules_of(root, self.block)])

    def memory(self, block):
        """Llama4MoE: routed rows, the shared expert added without a gate, the sigmoid router over all experts."""
        width = getattr(block.shared_expert.gate_proj, "base_layer", block.shared_expert.gate_proj).out_features
        return Llama4MoE(num_experts=block.experts.num_experts, top_k=block.router.top_k,
                         expert_dim=block.experts.expert_dim, norm_topk_prob=False, shared_dim=width, shared_gate=False)


def _patches(root):
    """The weightless q/k norms (their class is not the layers' norm class, which the driver patches)."""
    return [(m, weightless_rms_norm_forward) for _, m in modules_of(root, _QK_NORM)]


@dataclasses.dataclass(frozen=True)
class Llama4MoE(MoE):
    """Llama 4's MoE block for memory.estimate: memory.MoE's routed rows, shared expert (added without a gate) and
    router (the fp32 sigmoid over the scattered top-k logits, [t, E], and top-k's indices) with the indices the block
    takes again from the logits for the experts (t*top_k int64)."""

    def kept(self, tokens, mlp_size, size, recompute="selective"):
        parts = super().kept(tokens, mlp_size, size, recompute)
        parts["router_choice"] = tokens * self.top_k * 8
        return parts


def _shape(layer, config, spec):
    """config_shape with the layer's MLP width (intermediate_size_mlp) or Llama4MoE; q/k norms "rotated" (and their
    rows of ones) on RoPE layers with use_qk_norm; the temperature's scales on NoPE layers that tune it."""
    attn, mlp = layer.self_attn, layer.feed_forward
    dense = mlp.shared_expert if is_class(mlp, _BLOCK) else mlp
    fields = config_shape(layer, config, spec)  # a block's Llama4MoE: Llama4MoESpec.memory
    fields["activation"] = MLPPart(spec).shape(dense, config)["activation"]  # as the dense MLP applies it
    if not any(isinstance(p, MoE) for p in fields["parts"]):
        width = getattr(dense.gate_proj, "base_layer", dense.gate_proj).out_features
        fields.update(ffn_dim=width, mlp_ratio=width / fields["hidden_dim"])
    attention = next(p for p in fields["parts"] if isinstance(p, Attention))
    weightless, scaled = "qk_norm" in attn._modules, bool(not attn.use_rope and attn.attn_temperature_tuning)
    return with_parts(fields, dataclasses.replace(attention, weightless=weightless, query_scales=scaled))


SPEC = ModelSpec(model_types=("llama4_text",), layer="Llama4TextDecoderLayer",
                 children=(("input_layernorm", "norm"), ("self_attn", "attention"),
                           ("post_attention_layernorm", "norm"), ("feed_forward", "mlp")),
                 norm=NormSpec("rmsnorm", "Llama4TextRMSNorm"), attention="Llama4TextAttention",
                 attention_children=("q_proj", "k_proj", "v_proj", "o_proj"),
                 mlp=MLPSpec(_MLP, "gate_up", GATE_UP_ACTIVATION_FN_CHILDREN), shape=_shape,
                 qk_norm="rotated", qk_norm_children=("qk_norm",), attention_optional=("qk_norm",), check=check_llama4,
                 patches=_patches,
                 moe=Llama4MoESpec(_BLOCK, ("experts", "router", "shared_expert"), _EXPERTS, _ROUTER,
                                   block_forward=block_forward))
