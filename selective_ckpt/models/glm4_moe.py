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

from .checks import check_activation, check_children
from .errors import ConversionError
from .moe import MoESpec, _in_tiles, _records
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


# the router's scale by routed_scaling_factor keeps the float (scalars=1); the shared experts add without a gate
SPEC = llama_shaped("glm4_moe", "Glm4Moe", qk_norm=True, attention_optional=("q_norm", "k_norm"),
                    moe=MoESpec(_BLOCK, ("experts", "gate", "shared_experts"), "Glm4MoeExperts", "Glm4MoeTopkRouter",
                                block_forward=_block_forward, check=_check_block, weights_dtype=torch.float32,
                                ungated_shared="shared_experts", scalars=1))
