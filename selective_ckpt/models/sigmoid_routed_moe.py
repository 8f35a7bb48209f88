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
import types

import torch

from ..memory.estimate import MoE
from .errors import ConversionError
from .hf import GATE_UP_CHILDREN, MLPSpec, _check_activation, check_children
from .moe import MoESpec, _in_tiles, _records
from .patches import mlp_tiles, tiled_forward


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
    gated = types.SimpleNamespace(mlp=MLPSpec(f"{prefix}MLP", "gate_up", GATE_UP_CHILDREN))
    _check_activation(shared, f"{name}.shared_experts", model_type, gated)


def moe_spec(prefix, model_type):
    """The MoESpec of <prefix>MoE: <prefix>Experts behind <prefix>TopkRouter, plus <prefix>MLP shared experts."""
    return MoESpec(f"{prefix}MoE", ("experts", "gate", "shared_experts"), f"{prefix}Experts", f"{prefix}TopkRouter",
                   block_forward=_block_forward,
                   check=functools.partial(_check_block, prefix=prefix, model_type=model_type),
                   weights_dtype=torch.float32)


def is_block(mlp, prefix):
    return type(mlp).__name__ == f"{prefix}MoE"


def block_fields(block):
    """The LayerShape fields of such a block beside moe_shape's: its memory.MoE (routed experts, shared experts
    without a gate) and the router's float64 scale."""
    shared = getattr(block.shared_experts.gate_proj, "base_layer", block.shared_experts.gate_proj)
    moe = MoE(num_experts=block.experts.num_experts, top_k=block.gate.top_k, expert_dim=block.experts.intermediate_dim,
              weights_dtype=torch.float32, norm_topk_prob=bool(block.gate.norm_topk_prob),
              shared_dim=shared.out_features, shared_gate=False)
    return {"moe": moe, "scalar_multipliers": 1}
