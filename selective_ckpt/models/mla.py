"""Multi-head latent attention (DeepSeek-V3's DeepseekV3Attention), converted: what it keeps is docs/kernels/mla.md.

The patched forward is transformers' own, step for step (the same modules and functions on the same tensors, so
the same bits), except where it forms what attention reads: the query (q_pass beside the rotated q_rot) and the
key (k_nope beside the rotated single-head k_rot, repeated over the heads) are each made by one autograd node
(`_Rebuilt`) that keeps its inputs (views of the q_b_proj, kv_b_proj and kv_a_proj_with_mqa outputs, and the
position tables) and registers its output to be rebuilt from them; its backward runs the same function again
under autograd; the rotated k_rot is rebuilt the same way. attention's v is a view of the kv_b_proj output, which
the key's node keeps, so attention keeps that view instead of a copy (attention.VALUE_BUFFER_KEPT). A kv cache gets
the latent and the rotated k_rot as transformers gives it them; an empty one (a training forward with use_cache)
hands back copies of them, which are not read (the same bits), so kv_b_proj keeps the norm's rebuilt output, not
a copy. Calls without gradients (generate) or under torch.compile run transformers' forward as it is.
"""

import functools
import sys

import torch

from .. import compat
from ..double_backward import first_order_only
from ..keeping import pipeline
from . import attention
from .errors import ConversionError
from .patching import PATCHED

_ROPE, _ROPE_INTERLEAVED = "apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"


class _Rebuilt(torch.autograd.Function):
    """fn(*tensors), elementwise and cheap, keeping the tensors only: its output is registered to be rebuilt from
    them for its consumers, and backward differentiates fn run again on them."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        return fn(*tensors)

    @staticmethod
    @first_order_only("selective_ckpt.models.mla")
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip(saved, needs)]
            out = ctx.fn(*inputs)
        wanted = [t for t, need in zip(inputs, needs) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (None, *(next(grads) if need else None for need in needs))


def _rebuilt(fn, *tensors):
    """fn(*tensors) through _Rebuilt, registered to be rebuilt (pipeline.discardable) from the same tensors (from
    their rebuild where they are rebuilt themselves)."""
    out = _Rebuilt.apply(fn, *tensors)
    return pipeline.discardable(out, fn, *(pipeline.source(t) for t in tensors))


def _query(q, k_rot, cos, sin, nope, rope):
    """cat(q_pass, RoPE(q_rot)) as DeepseekV3Attention forms it (RoPE's q output does not depend on k)."""
    q_pass, q_rot = torch.split(q, [nope, q.shape[-1] - nope], dim=-1)
    q_rot, _ = rope(q_rot, k_rot, cos, sin)
    return torch.cat((q_pass, q_rot), dim=-1)


def _rotated_key(k_rot, cos, sin, rope):
    """RoPE(k_rot) of the one shared rotary key head (RoPE's k output does not depend on q: k_rot stands in)."""
    return rope(k_rot, k_rot, cos, sin)[1]


def _key(k_nope, k_rot):
    """k_nope beside the rotated k_rot repeated over the heads, as DeepseekV3Attention.expand_kv copies them."""
    return torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)


def _rope_of(module):
    """The RoPE function the module's forward calls (by config.rope_interleave), from its transformers module."""
    name = _ROPE_INTERLEAVED if module.config.rope_interleave else _ROPE
    rope = getattr(sys.modules.get(type(module).__module__), name, None)
    if rope is None:
        raise ConversionError(f"{type(module).__name__}: its module {type(module).__module__} defines no {name}")
    return rope


def _interface(module):
    """(the attention function the module's forward calls, whether it is ours), as transformers picks it."""
    family = sys.modules[type(module).__module__]
    impl = compat.attention_implementation(module.config)
    return family.ALL_ATTENTION_FUNCTIONS.get_interface(impl, family.eager_attention_forward), impl == attention.NAME


def check_attention(module, name):
    """ConversionError (naming the module and setting) for what the converted forward does not reproduce."""
    config = module.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads not in (None, heads):
        raise ConversionError(f"{name}: num_key_value_heads={kv_heads} differs from num_attention_heads={heads}; "
                              "multi-head latent attention expands its latent to every head (kv_b_proj), so only "
                              "num_key_value_heads == num_attention_heads is supported")
    _rope_of(module)


def mla_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """DeepseekV3Attention.forward with the query and key attention reads rebuilt in backward (see the module doc)."""
    if "past_key_values" in kwargs and cache is None:  # the name its deprecation wrapper still takes
        cache = kwargs.pop("past_key_values")
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return getattr(self, PATCHED)(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    batch, seq = hidden_states.shape[:-1]
    nope, rope_dim, value_dim = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q_a = pipeline.tag(self.q_a_proj(hidden_states), "qkv")
        q = self.q_b_proj(self.q_a_layernorm(q_a))
    q = pipeline.tag(q, "qkv").view(batch, seq, -1, self.qk_head_dim).transpose(1, 2)
    compressed = pipeline.tag(self.kv_a_proj_with_mqa(hidden_states), "qkv")
    latent, k_rot = torch.split(compressed, [self.kv_lora_rank, rope_dim], dim=-1)
    latent = self.kv_a_layernorm(latent).view(batch, 1, seq, self.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, seq, rope_dim)
    cos, sin = position_embeddings
    rope = _rope_of(self)
    rotated = _rebuilt(functools.partial(_rotated_key, rope=rope), k_rot, cos, sin)
    if cache is not None:  # it holds the latent and the rotated key; an empty one hands back copies of the same bits
        past = cache.get_seq_length(self.layer_idx)
        cached = cache.update(latent, rotated, self.layer_idx, kwargs=kwargs)
        if past:
            latent, rotated = cached
    kv = pipeline.tag(self.kv_b_proj(latent), "qkv").view(batch, -1, self.num_heads, nope + value_dim).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, value_dim], dim=-1)
    query = _rebuilt(functools.partial(_query, nope=nope, rope=rope), q, k_rot, cos, sin)
    key = _rebuilt(_key, k_nope, rotated)
    interface, ours = _interface(self)
    if ours:  # v is a view of kv_b_proj's output, which the key's node keeps: attention keeps the view
        kwargs[attention.VALUE_BUFFER_KEPT] = True
    out, weights = interface(self, query, key, value, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                             **kwargs)
    return self.o_proj(out.reshape(batch, seq, -1).contiguous()), weights
