"""Hugging Face Phi-3: RMSNorm patched in place; attention through the registry from the one packed qkv_proj
(q and k after RoPE, v compacted out of the packed output so only it is kept); the MLP's one packed
gate_up_proj output is all it keeps, the gated product rebuilt from its two halves; the residual dropouts
keep a seed each instead of a mask."""

from .spec import PACKED_GATE_UP_CHILDREN, MLPSpec, ModelSpec, NormSpec

SPEC = ModelSpec(
    model_types=("phi3",), layer="Phi3DecoderLayer",
    children=(("input_layernorm", "norm"), ("self_attn", "attention"), ("post_attention_layernorm", "norm"),
              ("mlp", "mlp"), ("resid_attn_dropout", "dropout"), ("resid_mlp_dropout", "dropout")),
    norm=NormSpec("rmsnorm", "Phi3RMSNorm"), attention="Phi3Attention", attention_children=("qkv_proj", "o_proj"),
    mlp=MLPSpec("Phi3MLP", "packed_gate_up", PACKED_GATE_UP_CHILDREN), dropout=True)
