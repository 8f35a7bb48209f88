"""Hugging Face Qwen2-MoE: Qwen2's attention (q/k/v biases) and norms; sparse MoE blocks (models/moe.py) with a
shared expert (a gated MLP) under a sigmoid gate, and dense Qwen2MoeMLP layers where mlp_only_layers or
decoder_sparse_step put them."""

from .moe import MoESpec, shared_expert_block_forward
from .spec import llama_shaped

SPEC = llama_shaped("qwen2_moe", "Qwen2Moe",
                    moe=MoESpec("Qwen2MoeSparseMoeBlock", ("gate", "experts", "shared_expert", "shared_expert_gate"),
                                "Qwen2MoeExperts", "Qwen2MoeTopKRouter", block_forward=shared_expert_block_forward,
                                shared=True))
