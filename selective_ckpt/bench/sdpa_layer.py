"""The decoder layer as a user writes it today: nn modules around PyTorch's SDPA.

Same computation and parameter names as SelectiveDecoderLayer (ln1, qkv, proj, ln2, fc1, fc2),
so the main job compares kernels, not architectures: pre-LN, fused qkv Linear,
scaled_dot_product_attention (is_causal), out-projection, GELU MLP, residual dropout.
"""

import torch.nn.functional as F
from torch import nn

from ..validation import ffn_dim


class SDPADecoderLayer(nn.Module):
    def __init__(self, hidden_dim, num_heads, mlp_ratio=4.0, dropout=0.0, attn_dropout=0.0, causal=True,
                 norm_eps=1e-5, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        ffn = ffn_dim(hidden_dim, mlp_ratio)
        self.num_heads, self.causal, self.dropout, self.attn_dropout = num_heads, causal, dropout, attn_dropout
        self.ln1 = nn.LayerNorm(hidden_dim, eps=norm_eps, **factory)
        self.qkv = nn.Linear(hidden_dim, 3 * hidden_dim, **factory)
        self.proj = nn.Linear(hidden_dim, hidden_dim, **factory)
        self.ln2 = nn.LayerNorm(hidden_dim, eps=norm_eps, **factory)
        self.fc1 = nn.Linear(hidden_dim, ffn, **factory)
        self.fc2 = nn.Linear(ffn, hidden_dim, **factory)

    def forward(self, x):
        B, S, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        p_attn = self.attn_dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p_attn, is_causal=self.causal)
        x = x + F.dropout(self.proj(o.transpose(1, 2).reshape(B, S, h)), self.dropout, self.training)
        m = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + F.dropout(m, self.dropout, self.training)
