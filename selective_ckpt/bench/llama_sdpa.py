"""The Llama-style decoder layer as a user writes it today: nn modules around PyTorch's SDPA.

The same computation and parameter names as SelectiveDecoderLayer(norm="rmsnorm",
activation="swiglu", num_kv_heads, rope_theta): Hugging Face's RMSNorm arithmetic (normalise in
float32, cast, times the weight), a packed qkv Linear with (H + 2 Hkv) head dims, rotary embeddings
in the rotate_half form, scaled_dot_product_attention with enable_gqa (k, v never expanded), the
out-projection and the SwiGLU MLP down(silu(gate(x)) * up(x)). No biases, as in Llama.
"""

import torch
import torch.nn.functional as F
from torch import nn


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_dim, eps, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        xf = x.to(torch.float32)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


class LlamaSDPALayer(nn.Module):
    def __init__(self, hidden_dim, num_heads, num_kv_heads, ffn_dim, rope_theta=500000.0, norm_eps=1e-5,
                 causal=True, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads, self.num_kv_heads, self.causal = num_heads, num_kv_heads, causal
        self.head_dim, self.rope_theta = hidden_dim // num_heads, rope_theta
        self.ln1 = LlamaRMSNorm(hidden_dim, norm_eps, **factory)
        self.qkv = nn.Linear(hidden_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=False, **factory)
        self.proj = nn.Linear(hidden_dim, hidden_dim, bias=False, **factory)
        self.ln2 = LlamaRMSNorm(hidden_dim, norm_eps, **factory)
        self.gate_proj = nn.Linear(hidden_dim, ffn_dim, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_dim, ffn_dim, bias=False, **factory)
        self.down_proj = nn.Linear(ffn_dim, hidden_dim, bias=False, **factory)

    def _cos_sin(self, S, x):
        """Hugging Face's tables: angles in float32, cos and sin cast to the activation dtype."""
        D = self.head_dim
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
        freqs = torch.arange(S, device=x.device, dtype=torch.float32)[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, x):
        B, S, h = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(self.ln1(x)).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = (t.view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
        cos, sin = self._cos_sin(S, x)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=Hkv != H)
        x = x + self.proj(o.transpose(1, 2).reshape(B, S, h))
        u = self.ln2(x)
        return x + self.down_proj(F.silu(self.gate_proj(u)) * self.up_proj(u))
