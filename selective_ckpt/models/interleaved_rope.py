"""The attention forward of families whose RoPE is interleaved (GLM-4, ERNIE 4.5): transformers' own forward
(q/k/v projections, rotary, kv cache, the registered attention function, o_proj), with one difference. Their
apply_rotary_pos_emb repeats each frequency of cos and sin twice inside every layer, and the products that rotate
q and k save those repeated tables: each layer would keep 2 tables of positions x rotary dim. Here the repeated
tables are made once per model forward (held by the cos tensor the model hands every layer) and shared, with the
same ops on the same values, so the bits are transformers' and a layer keeps none of them."""

import torch

from .. import compat

_TABLES = "_selective_ckpt_interleaved"  # attribute of the model's cos: (sin, repeated cos, repeated sin)


def _repeat(t):
    # transformers: cos.unsqueeze(1), then cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    t = t.unsqueeze(1)
    return t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1)


def interleaved_tables(cos, sin):
    """(cos, sin) with each frequency repeated twice, made once for a given (cos, sin) pair."""
    if torch.compiler.is_compiling():  # no attributes on traced tensors; the compiled graph decides what it keeps
        return _repeat(cos), _repeat(sin)
    held = getattr(cos, _TABLES, None)
    if held is None or held[0] is not sin:
        held = (sin, _repeat(cos), _repeat(sin))
        setattr(cos, _TABLES, held)
    return held[1], held[2]


def rotate_glm(q, k, cos, sin, rotate_half):
    """modeling_glm4.apply_rotary_pos_emb on repeated tables: the first cos.shape[-1] dims of each head rotated,
    the rest passed through."""
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def rotate_ernie(q, k, cos, sin, rotate_half):
    """modeling_ernie4_5.apply_rotary_pos_emb on repeated tables: the whole head, in float32, rounded back."""
    dtype = q.dtype
    q_embed = (q.float() * cos) + (rotate_half(q).float() * sin)
    k_embed = (k.float() * cos) + (rotate_half(k).float() * sin)
    return q_embed.to(dtype), k_embed.to(dtype)


def attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, *, modeling,
                      rotate, past_key_values=None, **kwargs):
    """<Family>Attention.forward with the rotary tables shared (interleaved_tables); `modeling`: the family's
    transformers module (its rotate_half and eager_attention_forward), `rotate`: rotate_glm or rotate_ernie."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if cache is None:
        cache = past_key_values  # the name transformers' forward still takes (deprecate_kwarg)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = interleaved_tables(*position_embeddings)
    query_states, key_states = rotate(query_states, key_states, cos, sin, modeling.rotate_half)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(compat.attention_implementation(self.config),
                                                                modeling.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights
