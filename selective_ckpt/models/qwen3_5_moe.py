"""Hugging Face Qwen3.5-MoE text models (Qwen3_5MoeForCausalLM on Qwen3_5MoeTextConfig, model type
"qwen3_5_moe_text"): Qwen3.5's hybrid layer (models/hybrid.py) with a sparse MoE block in every layer: routed
experts (models/moe.py) and a shared expert under a sigmoid gate, as Qwen2-MoE's; the router normalises its top-k
weights always."""

from .hybrid import HYBRID_CHILDREN, attention_patches, check_attention, deltanet
from .moe import MoESpec, shared_expert_block_forward
from .spec import GATE_UP_CHILDREN, MLPSpec, NormSpec, llama_shaped

SPEC = llama_shaped("qwen3_5_moe_text", "Qwen3_5Moe", children=HYBRID_CHILDREN,
                    norm=NormSpec("rmsnorm", "Qwen3_5MoeRMSNorm", offset=1.0), qk_norm=True, attention_gate=True,
                    mixer=deltanet("Qwen3_5Moe"), patches=attention_patches("Qwen3_5MoeAttention"),
                    check=check_attention("Qwen3_5MoeAttention"),
                    mlp=MLPSpec("Qwen3_5MoeMLP", "gate_up", GATE_UP_CHILDREN),
                    moe=MoESpec("Qwen3_5MoeSparseMoeBlock", ("gate", "experts", "shared_expert", "shared_expert_gate"),
                                "Qwen3_5MoeExperts", "Qwen3_5MoeTopKRouter", block_forward=shared_expert_block_forward,
                                shared=True))
