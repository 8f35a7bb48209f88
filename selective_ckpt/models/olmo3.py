"""Hugging Face OLMo 3: OLMo2's layer (post-norms on the attention and MLP outputs, q/k RMSNorms over the
whole q_proj / k_proj output, the float32-scale RMSNorm that runs its own forward and keeps only its input),
with sliding-window layers by config.layer_types (each attention module's own sliding_window reaches the
kernel) and a rope table per layer type, computed by transformers' own rotary module."""

from .spec import NormSpec, llama_shaped

SPEC = llama_shaped("olmo3", "Olmo3", children=(("self_attn", "attention"), ("post_attention_layernorm", "norm"),
                                                ("mlp", "mlp"), ("post_feedforward_layernorm", "norm")),
                    norm=NormSpec("rmsnorm", "Olmo3RMSNorm", rounding="float32_scale"), residual="post-norm",
                    qk_norm="projection")
