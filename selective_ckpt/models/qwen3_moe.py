"""Hugging Face Qwen3-MoE: Qwen3's attention (q/k norms per head) and norms; sparse MoE blocks (models/moe.py)
and dense Qwen3MoeMLP layers where mlp_only_layers or decoder_sparse_step put them."""

from .moe import MoESpec
from .spec import llama_shaped

SPEC = llama_shaped("qwen3_moe", "Qwen3Moe", qk_norm=True,
                    moe=MoESpec("Qwen3MoeSparseMoeBlock", ("experts", "gate"), "Qwen3MoeExperts", "Qwen3MoeTopKRouter"))
