"""Sparse MoE blocks of routed experts plus shared experts added without a gate, behind transformers' sigmoid router
with group-limited top-k: GLM-4.5's Glm4MoeMoE and DeepSeek-V3's DeepseekV3MoE (the same code under two names).

The routed experts convert as every family's (models/moe.py: each routed row keeps its gate and up outputs); the
shared experts are one gated MLP of the family's MLP class (its gate and up kept, the product rebuilt). The router
is transformers' own: sigmoid scores, e_score_correction_bias for choosing, top-k within the best topk_group of
n_group groups, weights taken from the scores, normalised by norm_topk_prob and scaled by routed_scaling_factor; it
keeps the sigmoid output, the chosen indices and weights (and with norm_topk_prob their sum and a copy), and the
scale as a float64 scalar.
"""

import functools

import torch

from .checks import check_activation, check_children
from .errors import ConversionError
from .moe import MoESpec, _in_tiles, _records
from .patches import mlp_tiles, tiled_forward
from .spec import GATE_UP_CHILDREN


def _rows(block, x):
    """Routed experts plus shared experts on rows x [n, h], as the block's forward adds them."""
    _, weights, index = block.gate(x)
    return block.experts(x, index, weights) + block.shared_experts(x)


@tiled_forward
def _block_forward(self, hidden_states):
    """transformers' own block forward, or with the layer's mlp_tiles > 1 and autograd recording, router, experts
    and shared experts over sequence tiles (moe._in_tiles)."""
    if mlp_tiles(self) == 1 or not _records(self, hidden_states):
        return type(self).forward(self, hidden_states)
    return _in_tiles(self, hidden_states, _rows)


def _check_block(block, name, prefix, model_type):
    shared = block.shared_experts
    if type(shared).__name__ != f"{prefix}MLP":
        raise ConversionError(f"{name}.shared_experts is a {type(shared).__name__}, not {prefix}MLP; it cannot be "
                              "converted")
    check_children(shared, f"{name}.shared_experts", GATE_UP_CHILDREN, model_type)
    check_activation(shared, f"{name}.shared_experts", model_type, GATE_UP_CHILDREN[3])


def moe_spec(prefix, model_type):
    """The MoESpec of <prefix>MoE: <prefix>Experts behind <prefix>TopkRouter, plus <prefix>MLP shared experts added
    without a gate; the router's scale by routed_scaling_factor keeps the float (scalars=1)."""
    return MoESpec(f"{prefix}MoE", ("experts", "gate", "shared_experts"), f"{prefix}Experts", f"{prefix}TopkRouter",
                   block_forward=_block_forward,
                   check=functools.partial(_check_block, prefix=prefix, model_type=model_type),
                   weights_dtype=torch.float32, ungated_shared="shared_experts", scalars=1)
