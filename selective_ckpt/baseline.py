"""The plain eager pre-LN decoder layer that selective_ckpt is measured against and converts from.

nn.MultiheadAttention with its default arguments (it returns averaged attention weights, so the
softmax is materialised), two LayerNorms and a Linear-GELU-Linear MLP. Everything is stored for
backward: this is the memory and speed baseline of the benchmark.
"""

import torch
from torch import nn


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
