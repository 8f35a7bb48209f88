"""Hybrid decoders (Qwen3-Next, Qwen3.5): full-attention layers and linear-attention layers in one stack.

A full-attention layer converts as any other; its attention is gated: q_proj emits per head q and a gate,
y = o_proj(o * sigmoid(gate)), with (1 + w) RMSNorms on q and k per head before RoPE. The patched attention
forward (`gated_attention_forward`) is transformers' own but for the gate, which runs in one autograd node
(`_SigmoidGate`) keeping o (attention keeps it anyway) and the gate (a view of the q_proj output, which the q
norm keeps as its input): its output o_proj's input is a norm_act output of the pipeline, rebuilt in backward
where the policy rebuilds those, so the gate adds nothing to what the layer keeps under "selective" (transformers
keeps sigmoid(gate) and the product, 2*H*D elements per token).

A linear-attention layer holds a Gated DeltaNet instead (`spec.MixerSpec`): its norms, MLP or MoE and dropouts
convert, the DeltaNet keeps transformers' implementation (fla's kernels where installed, else its torch
chunked recurrence) and what that saves, which no kernel of ours reproduces. memory.estimate counts that as a
`memory.Mixer` whose bytes come from running the module's own forward on fake tensors (models/kept_mixer.py),
so the count follows whatever implementation transformers runs for the shape."""

import sys

import torch

from .. import compat
from ..double_backward import first_order_only
from ..keeping import pipeline
from .checks import modules_of
from .errors import ConversionError
from .patches import rebuilt_in_backward
from .spec import MixerSpec

DELTANET_WHY = ("its gated delta rule (short convolution, chunked recurrence, gated RMSNorm) has no kernel here; "
                "its forward and what it saves for backward are transformers'")


def deltanet(prefix):
    """The MixerSpec of a <prefix>GatedDeltaNet."""
    return MixerSpec(f"{prefix}GatedDeltaNet", DELTANET_WHY)


HYBRID_CHILDREN = (("input_layernorm", "norm"), ("self_attn", "attention"), ("linear_attn", "mixer"),
                   ("post_attention_layernorm", "norm"), ("mlp", "mlp"))


# --- The gated attention of the full-attention layers.

def _gate(o, gate):
    """o [..., H*D] * sigmoid(gate) for the gate [..., H, D], a view of q_proj's output: the product transformers
    forms after copying the gate into [..., H*D] (the same elementwise values), without that copy."""
    return (o.view(gate.shape) * torch.sigmoid(gate)).view(o.shape)


class _SigmoidGate(torch.autograd.Function):
    """o * sigmoid(gate), as transformers computes it (sigmoid in the gate's dtype, one multiply); keeps o and
    the gate view, never sigmoid(gate), the gate's copy or the product."""

    @staticmethod
    def forward(ctx, o, gate):
        ctx.save_for_backward(o, gate)
        return _gate(o, gate)

    @staticmethod
    @first_order_only("selective_ckpt.models.hybrid.sigmoid_gate")
    def backward(ctx, dy):
        o, gate = ctx.saved_tensors
        s = torch.sigmoid(gate)
        dy = dy.view(gate.shape)
        do = (dy * s).view(o.shape) if ctx.needs_input_grad[0] else None
        dgate = dy * o.view(gate.shape) * s * (1 - s) if ctx.needs_input_grad[1] else None
        return do, dgate


def sigmoid_gate(o, gate):
    """o * sigmoid(gate) whose output is a norm_act output of the layer's pipeline (rebuilt from o and the gate)."""
    pipeline.tag(gate, "qkv", if_untagged=True)  # a view of q_proj's output (the q norm names it first)
    if pipeline.compiled_rebuilds():
        return rebuilt_in_backward(_gate, o, gate)
    if not torch.is_grad_enabled() or not (o.requires_grad or gate.requires_grad):
        return _gate(o, gate)
    y = _SigmoidGate.apply(o, gate)
    return pipeline.discardable(y, _gate, o, gate)


def gated_attention_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None,
                            past_key_values=None, **kwargs):
    """<prefix>Attention.forward (Qwen3-Next, Qwen3.5) with the output gate through sigmoid_gate; the rotary
    embedding, the kv cache and the attention function are transformers' own."""
    modeling = sys.modules[type(self).__module__]
    cache = past_key_values if cache is None else cache
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
    query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    attention_interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(compat.attention_implementation(self.config),
                                                                         modeling.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = sigmoid_gate(attn_output, gate)
    return self.o_proj(attn_output), attn_weights


def attention_patches(attention_cls):
    """ModelSpec.patches: every `attention_cls` module gets gated_attention_forward."""
    def patches(root):
        return [(m, gated_attention_forward) for _, m in modules_of(root, attention_cls)]

    return patches


def check_attention(attention_cls):
    """ModelSpec.check: the gated attention's layout, which gated_attention_forward reads, or ConversionError."""
    def check(root, name):
        for n, attn in modules_of(root, attention_cls):
            heads = attn.config.num_attention_heads
            out = getattr(attn.q_proj, "base_layer", attn.q_proj).out_features
            if out != 2 * heads * attn.head_dim:
                raise ConversionError(f"{name}: {n}.q_proj gives {out} features, not q and a gate per head "
                                      f"(2 x {heads} x {attn.head_dim}); it cannot be converted")

    return check
