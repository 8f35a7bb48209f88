"""Hugging Face OLMo2: post-norm layers (RMSNorm on the attention and MLP outputs before each residual add) and
q/k RMSNorms over the whole q_proj / k_proj output, from whose inputs attention's rotated q and k are rebuilt
(attention.qk_normed_forward). Its RMSNorm scales in float32 and rounds once, an order
the kernels do not have: each norm runs its own forward, keeping only its input (a matmul output), and
runs again in backward."""

from .spec import NormSpec, llama_shaped

SPEC = llama_shaped("olmo2", "Olmo2", children=(("self_attn", "attention"), ("post_attention_layernorm", "norm"),
                                                ("mlp", "mlp"), ("post_feedforward_layernorm", "norm")),
                    norm=NormSpec("rmsnorm", "Olmo2RMSNorm", rounding="float32_scale"), residual="post-norm",
                    qk_norm="projection")
