"""Hugging Face GPT-2: LayerNorm, the MLP's activation and every dropout patched in place; attention through
the registry.

GPT2Block, its Conv1D projections and parameter names stay. ln_1/ln_2/ln_f run the fused LayerNorm
kernel (keeps x, mean, rstd; the output is rebuilt for c_attn / c_fc / lm_head), GPT2MLP's activation
keeps its input (c_fc's output) and its output is rebuilt for c_proj, and resid_pdrop/embd_pdrop
dropouts keep a seed instead of a mask. attn_pdrop goes to the attention kernel by seed.
"""

from torch import nn

from .errors import ConversionError
from .spec import MLPSpec, ModelSpec, NormSpec


def _check(root, name):
    if getattr(root.config, "add_cross_attention", False):
        raise ConversionError(f"{name}: GPT2Block with cross-attention cannot be converted (self-attention only)")


SPEC = ModelSpec(
    model_types=("gpt2",), layer="GPT2Block",
    children=(("ln_1", "norm"), ("attn", "attention"), ("ln_2", "norm"), ("mlp", "mlp")),
    norm=NormSpec("layernorm", nn.LayerNorm), attention="GPT2Attention",
    attention_children=("c_attn", "c_proj", "attn_dropout", "resid_dropout"),
    mlp=MLPSpec("GPT2MLP", "fc", ("c_fc", "act", "c_proj", "dropout")),
    dropout=True, check=_check)
