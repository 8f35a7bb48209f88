"""Rotary position embeddings (RoPE, Su et al. 2021) on the packed q/k/v buffer, keeping no activation.

Half-split form (Hugging Face's rotate_half): a head vector [x1, x2] at position p becomes
[x1 c - x2 s, x2 c + x1 s] with c, s = cos, sin(p * theta^(-2i/D)), i < D/2. The rotation is applied
in float32 and rounded once. Backward applies the inverse rotation (angle -p) to dq and dk, so
autograd keeps only the positions (nothing at all for the default 0..S-1): never the pre-rotation
q, k. The tables are rebuilt in backward from the positions (angles in float64, then float32).
"""

import torch


def rope_tables(positions, head_dim, theta, device):
    """cos, sin [B or 1, S, D/2] float32 for int positions [B or 1, S]."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = positions.to(device=device, dtype=torch.float64)[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def _positions(seq_len, position_ids, device):
    if position_ids is None:
        return torch.arange(seq_len, device=device)[None]
    return position_ids


def _rotate(part, cos, sin, heads, head_dim, inverse):
    """Rotates part [B, S, heads * D] (a view) into a new float32 tensor of the same shape."""
    B, S, _ = part.shape
    half = head_dim // 2
    v = part.reshape(B, S, heads, head_dim).float()
    x1, x2 = v[..., :half], v[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if inverse:
        s = -s
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(B, S, heads * head_dim)


def _apply(qkv, cos, sin, num_heads, num_kv_heads, head_dim, inverse):
    """A new packed buffer: the q and k parts rotated, the v part copied."""
    out = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    nq, nk = num_heads * head_dim, num_kv_heads * head_dim
    out[..., :nq] = _rotate(qkv[..., :nq], cos, sin, num_heads, head_dim, inverse)
    out[..., nq:nq + nk] = _rotate(qkv[..., nq:nq + nk], cos, sin, num_kv_heads, head_dim, inverse)
    out[..., nq + nk:] = qkv[..., nq + nk:]
    return out


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, position_ids, num_heads, num_kv_heads, head_dim, theta):
        cos, sin = rope_tables(_positions(qkv.shape[1], position_ids, qkv.device), head_dim, theta, qkv.device)
        ctx.dims = (qkv.shape[1], num_heads, num_kv_heads, head_dim, theta)
        ctx.save_for_backward(position_ids)
        return _apply(qkv, cos, sin, num_heads, num_kv_heads, head_dim, inverse=False)

    @staticmethod
    def backward(ctx, grad):
        (position_ids,) = ctx.saved_tensors
        S, num_heads, num_kv_heads, head_dim, theta = ctx.dims
        cos, sin = rope_tables(_positions(S, position_ids, grad.device), head_dim, theta, grad.device)
        return _apply(grad, cos, sin, num_heads, num_kv_heads, head_dim, inverse=True), None, None, None, None, None


def rope_qkv(qkv, position_ids, num_heads, num_kv_heads, head_dim, theta):
    """qkv [B, S, (H + 2 Hkv) * D] -> the same layout with q and k rotated (a new buffer, v copied).

    position_ids: int tensor [B or 1, S] or None for 0..S-1. Autograd keeps only position_ids.
    """
    return _RopeQKV.apply(qkv, position_ids, num_heads, num_kv_heads, head_dim, theta)


def check_position_ids(position_ids, x):
    """position_ids as an int tensor [B or 1, S] on x's device, or the error naming what is expected."""
    if position_ids is None:
        return None
    B, S = x.shape[:2]
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("position_ids must be an int32/int64 tensor [B, S] (or [1, S]) or None")
    if position_ids.dim() != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids must have shape [{B}, {S}] or [1, {S}], got {list(position_ids.shape)}")
    if position_ids.device != x.device:
        raise ValueError(f"position_ids must be on x's device {x.device}, got {position_ids.device}")
    return position_ids
