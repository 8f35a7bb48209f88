"""Hugging Face Apertus: pre-norm RMSNorm layers (attention_layernorm, feedforward_layernorm), per-head q/k
RMSNorms (q_norm, k_norm before RoPE) as Qwen3's, and a plain MLP up_proj -> act_fn -> down_proj (the "fc"
layout). Its xIELU activation (transformers.activations.XIELUActivation, with the trainable alpha_p and
alpha_n) is called as the elementwise activation module it is: its own forward runs in an autograd node that
keeps up_proj's output only and runs that forward again in backward (patches.activate), so the MLP keeps
what a GELU MLP keeps and the alphas get their gradients. Its llama3 RoPE stays in transformers' own forward."""

from .spec import MLPSpec, llama_shaped

SPEC = llama_shaped("apertus", "Apertus", children=(("attention_layernorm", "norm"), ("self_attn", "attention"),
                                                    ("feedforward_layernorm", "norm"), ("mlp", "mlp")),
                    mlp=MLPSpec("ApertusMLP", "fc", ("up_proj", "act_fn", "down_proj")), qk_norm=True)
