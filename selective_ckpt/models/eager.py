"""The plain eager pre-LN decoder layer that selective_ckpt is measured against, and its conversion.

EagerDecoderLayer: nn.MultiheadAttention with its default arguments (it returns averaged attention
weights, so the softmax is materialised), two LayerNorms and a Linear-GELU-Linear MLP. Everything
is stored for backward: the memory and speed baseline of the benchmark.

Any module shaped like it (pre-LN ln1 -> nn.MultiheadAttention -> dropout, ln2 -> mlp =
Sequential(Linear, GELU, Linear[, Dropout])) converts to a SelectiveDecoderLayer.
"""

import torch
from torch import nn

from ..layers import SelectiveDecoderLayer
from ..registry import register_layer_type
from .errors import ConversionError


@register_layer_type
class EagerDecoderLayer(nn.Module):
    def __init__(self, hidden_dim, num_heads, mlp_ratio=4.0, dropout=0.0, attn_dropout=0.0, causal=True,
                 norm_eps=1e-5, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        ffn = int(hidden_dim * mlp_ratio)
        self.causal = causal
        self.ln1 = nn.LayerNorm(hidden_dim, eps=norm_eps, **factory)
        self.attn = nn.MultiheadAttention(hidden_dim, num_heads, dropout=attn_dropout, batch_first=True, **factory)
        self.dropout = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(hidden_dim, eps=norm_eps, **factory)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_dim, ffn, **factory),
            nn.GELU(),
            nn.Linear(ffn, hidden_dim, **factory),
            nn.Dropout(dropout),
        )

    def forward(self, x, attention_mask=None):
        """x [B, S, hidden]; attention_mask [B, S] bool, True = attend."""
        s = x.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1) if self.causal else None
        padding = None if attention_mask is None else ~attention_mask
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=causal, key_padding_mask=padding)
        x = x + self.dropout(a)
        return x + self.mlp(self.ln2(x))


def _factory(module):
    """device and dtype of a module's parameters, for building its replacement."""
    p = next(module.parameters())
    return {"device": p.device, "dtype": p.dtype}


@torch.no_grad()
def _copy_param(dst, src):
    dst.copy_(src)
    dst.requires_grad_(src.requires_grad)


def matches(module):
    mlp = getattr(module, "mlp", None)
    return (isinstance(getattr(module, "attn", None), nn.MultiheadAttention)
            and isinstance(getattr(module, "ln1", None), nn.LayerNorm)
            and isinstance(getattr(module, "ln2", None), nn.LayerNorm)
            and isinstance(mlp, nn.Sequential) and len(mlp) >= 3 and isinstance(mlp[0], nn.Linear)
            and isinstance(mlp[2], nn.Linear))


def convert_block(module, name, recompute):
    attn, mlp = module.attn, module.mlp
    if not isinstance(mlp[1], nn.GELU):
        raise ConversionError(f"{name}: activation {type(mlp[1]).__name__} is not supported (only nn.GELU)")
    extra = list(mlp)[3:]
    if len(extra) > 1 or (extra and not isinstance(extra[0], nn.Dropout)):
        raise ConversionError(f"{name}: mlp must be Linear, GELU, Linear[, Dropout], got {list(map(type, mlp))}")
    if not attn.batch_first:
        raise ConversionError(f"{name}: nn.MultiheadAttention must be batch_first=True")
    if not attn._qkv_same_embed_dim or attn.bias_k is not None or attn.add_zero_attn or attn.in_proj_weight is None:
        raise ConversionError(f"{name}: nn.MultiheadAttention with kdim/vdim, add_bias_kv or add_zero_attn is not "
                              "self-attention as SelectiveDecoderLayer computes it")
    resid = module.dropout.p if isinstance(getattr(module, "dropout", None), nn.Dropout) else 0.0
    mlp_p = extra[0].p if extra else 0.0
    if resid != mlp_p:
        raise ConversionError(f"{name}: attention and MLP residual dropouts differ ({resid}, {mlp_p})")
    lns = (module.ln1, module.ln2)
    if any(ln.weight is None for ln in lns) or module.ln1.eps != module.ln2.eps:
        raise ConversionError(f"{name}: LayerNorms must be affine with one eps")
    biases = {attn.in_proj_bias is not None, attn.out_proj.bias is not None, mlp[0].bias is not None,
              mlp[2].bias is not None, module.ln1.bias is not None, module.ln2.bias is not None}
    if len(biases) != 1:
        raise ConversionError(f"{name}: either every projection and LayerNorm has a bias or none does")
    bias = biases.pop()
    hidden, heads = attn.embed_dim, attn.num_heads
    inner = mlp[0].out_features
    layer = SelectiveDecoderLayer(hidden, heads, mlp_ratio=inner / hidden, dropout=float(resid),
                                  attn_dropout=float(attn.dropout), causal=bool(getattr(module, "causal", True)),
                                  activation="gelu_tanh" if mlp[1].approximate == "tanh" else "gelu",
                                  norm_eps=module.ln1.eps, bias=bias, recompute=recompute, **_factory(module))
    pairs = [(layer.ln1.weight, module.ln1.weight), (layer.ln2.weight, module.ln2.weight),
             (layer.qkv.weight, attn.in_proj_weight), (layer.proj.weight, attn.out_proj.weight),
             (layer.fc1.weight, mlp[0].weight), (layer.fc2.weight, mlp[2].weight)]
    if bias:
        pairs += [(layer.ln1.bias, module.ln1.bias), (layer.ln2.bias, module.ln2.bias),
                  (layer.qkv.bias, attn.in_proj_bias), (layer.proj.bias, attn.out_proj.bias),
                  (layer.fc1.bias, mlp[0].bias), (layer.fc2.bias, mlp[2].bias)]
    for dst, src in pairs:
        _copy_param(dst, src)
    return layer
