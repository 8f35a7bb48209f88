"""Hugging Face Qwen3-Next (Qwen3NextForCausalLM): a hybrid stack by config.layer_types (three linear-attention
layers to each full-attention one in Qwen3-Next-80B-A3B) of (1 + w) RMSNorms, sparse MoE blocks with a shared
expert under a sigmoid gate (Qwen2-MoE's, models/moe.py) or dense Qwen3NextMLP layers where mlp_only_layers or
decoder_sparse_step put them. Full-attention layers: gated attention with per-head (1 + w) q/k norms and partial
RoPE (models/hybrid.py: the gate's product rebuilt). Linear-attention layers: the Gated DeltaNet stays
transformers' own module and keeps what it saves (spec.MixerSpec, said once at convert); their norms and MLP
convert."""

from .hybrid import HYBRID_CHILDREN, attention_patches, check_attention, deltanet
from .moe import MoESpec, shared_expert_block_forward
from .spec import NormSpec, llama_shaped

SPEC = llama_shaped("qwen3_next", "Qwen3Next", children=HYBRID_CHILDREN,
                    norm=NormSpec("rmsnorm", "Qwen3NextRMSNorm", offset=1.0), qk_norm=True, attention_gate=True,
                    mixer=deltanet("Qwen3Next"), patches=attention_patches("Qwen3NextAttention"),
                    check=check_attention("Qwen3NextAttention"),
                    moe=MoESpec("Qwen3NextSparseMoeBlock", ("gate", "experts", "shared_expert", "shared_expert_gate"),
                                "Qwen3NextExperts", "Qwen3NextTopKRouter", block_forward=shared_expert_block_forward,
                                shared=True))
