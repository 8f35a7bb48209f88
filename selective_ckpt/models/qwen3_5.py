"""Hugging Face Qwen3.5 text models (Qwen3_5ForCausalLM on Qwen3_5TextConfig, model type "qwen3_5_text"): Qwen3-Next's
hybrid layer (models/hybrid.py) with a dense gated MLP in every layer: full-attention layers with gated attention,
per-head (1 + w) q/k norms and its interleaved multimodal RoPE (transformers' own rotary module); linear-attention
layers whose Gated DeltaNet (separate q/k/v, z, b and a projections) stays transformers' own, said once at
convert."""

from .hybrid import HYBRID_CHILDREN, attention_patches, check_attention, deltanet
from .spec import NormSpec, llama_shaped

SPEC = llama_shaped("qwen3_5_text", "Qwen3_5", children=HYBRID_CHILDREN,
                    norm=NormSpec("rmsnorm", "Qwen3_5RMSNorm", offset=1.0), qk_norm=True, attention_gate=True,
                    mixer=deltanet("Qwen3_5"), patches=attention_patches("Qwen3_5Attention"),
                    check=check_attention("Qwen3_5Attention"))
