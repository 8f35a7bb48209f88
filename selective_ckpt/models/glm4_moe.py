"""Hugging Face GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): Llama-shaped layers with q/k/v biases by
config.attention_bias, partial RoPE (transformers' own attention forward), per-head q/k RMSNorms before RoPE
when config.use_qk_norm, dense Glm4MoeMLP layers before config.first_k_dense_replace and sparse MoE blocks
after it. A block is routed experts (models/moe.py, each routed row keeping its gate and up outputs) plus
shared experts, one gated Glm4MoeMLP added without a gate (its gate and up kept, the product rebuilt). The
router is transformers' own: sigmoid scores, the e_score_correction_bias for choosing, top-k within the best
topk_group of n_group groups, weights taken from the scores, normalised by norm_topk_prob and scaled by
routed_scaling_factor; it keeps the sigmoid output, the chosen indices and weights (and with norm_topk_prob
their sum and a copy), and the scale as a float64 scalar."""

import torch

from ..memory.estimate import MoE
from .checks import check_activation, check_children
from .errors import ConversionError
from .layer_shape import config_shape
from .moe import MoESpec, _in_tiles, _records, moe_shape
from .patches import mlp_tiles, tiled_forward
from .spec import llama_shaped

_BLOCK = "Glm4MoeMoE"


def _rows(block, x):
    """Routed experts plus shared experts on rows x [n, h], as Glm4MoeMoE.forward adds them."""
    _, weights, index = block.gate(x)
    return block.experts(x, index, weights) + block.shared_experts(x)


@tiled_forward
def _block_forward(self, hidden_states):
    """Glm4MoeMoE: transformers' own forward, or with the layer's mlp_tiles > 1 and autograd recording, router,
    experts and shared experts over sequence tiles (moe._in_tiles)."""
    if mlp_tiles(self) == 1 or not _records(self, hidden_states):
        return type(self).forward(self, hidden_states)
    return _in_tiles(self, hidden_states, _rows)


def _check_block(block, name):
    shared = block.shared_experts
    if type(shared).__name__ != "Glm4MoeMLP":
        raise ConversionError(f"{name}.shared_experts is a {type(shared).__name__}, not Glm4MoeMLP; it cannot be "
                              "converted")
    check_children(shared, f"{name}.shared_experts", ("gate_proj", "up_proj", "down_proj", "act_fn"), "glm4_moe")
    check_activation(shared, f"{name}.shared_experts", "glm4_moe", SPEC.mlp.activation)


def _shape(layer, config, spec):
    """config_shape (a dense layer) or moe_shape with the block's memory.MoE: its routed experts, shared experts
    without a gate, and the router's float64 scale; q/k norms only where config.use_qk_norm."""
    qk = {"qk_norm": True} if getattr(config, "use_qk_norm", False) else {}
    if type(layer.mlp).__name__ != _BLOCK:
        fields = config_shape(layer, config, spec)
        fields.pop("qk_norm", None)
        return {**fields, **qk}
    fields = moe_shape(layer, config, spec)
    fields.pop("qk_norm", None)
    block = layer.mlp
    shared = getattr(block.shared_experts.gate_proj, "base_layer", block.shared_experts.gate_proj)
    moe = MoE(num_experts=block.experts.num_experts, top_k=block.gate.top_k, expert_dim=block.experts.intermediate_dim,
              weights_dtype=torch.float32, norm_topk_prob=bool(block.gate.norm_topk_prob),
              shared_dim=shared.out_features, shared_gate=False)
    return {**fields, **qk, "moe": moe, "scalar_multipliers": 1}


SPEC = llama_shaped("glm4_moe", "Glm4Moe", shape=_shape, qk_norm=True, attention_optional=("q_norm", "k_norm"),
                    moe=MoESpec(_BLOCK, ("experts", "gate", "shared_experts"), "Glm4MoeExperts", "Glm4MoeTopkRouter",
                                block_forward=_block_forward, check=_check_block, weights_dtype=torch.float32))
