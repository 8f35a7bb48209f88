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
`memory.Mixer` whose bytes come from running the module's own forward on fake tensors (`mixer_saved_bytes`),
so the count follows whatever implementation transformers runs for the shape."""

import functools
import sys
import weakref

import torch

from .. import compat
from ..double_backward import first_order_only
from ..keeping import pipeline
from ..memory.estimate import Mixer
from ..storages import storage_bytes, storage_id
from .checks import modules_of
from .errors import ConversionError
from .layer_shape import config_shape
from .moe import moe_shape
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


# --- What a kept mixer saves: its own forward run on fake tensors.

class _Held:
    """What the fake run's pack hook hands autograd: alive exactly as long as the graph node that saved it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _run_fake(mixer, seq_len, batch, dtype, compute_dtype):
    """Bytes of the distinct storages the graph behind the mixer's output still holds after its forward: saved
    by a node the output reaches (a branch whose result is dropped, such as the final recurrent state, frees its
    nodes and what they saved), its input, parameters and buffers excluded."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = next(mixer.parameters()).device
    held = []

    def pack(t):
        # a detached alias: a node saving its own output would otherwise hold itself through the holder, a cycle
        # that keeps a dropped branch's nodes alive
        h = _Held(t.detach())
        held.append((weakref.ref(h), storage_id(t), storage_bytes(t)))
        return h

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        params = {n: mode.from_tensor(p) for n, p in mixer.named_parameters()}
        for n, p in mixer.named_parameters():
            params[n].requires_grad_(p.requires_grad)
        # buffers (Falcon-H1's MuP vector) are the module's, allocated before any forward, as its parameters are
        buffers = {n: mode.from_tensor(b) for n, b in mixer.named_buffers()}
        x = torch.empty(batch, seq_len, mixer.hidden_size, dtype=dtype, device=device, requires_grad=True)
        autocast = torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != dtype)
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor):
            y = torch.func.functional_call(mixer, {**params, **buffers}, (x,))
        skip = {storage_id(p) for p in (*params.values(), *buffers.values())} | {storage_id(x)}
        alive = {sid: nbytes for ref, sid, nbytes in held if ref() is not None and sid not in skip}
        alive.update(_unhooked(y, skip | {sid for _, sid, _ in held}))
        del y
    return sum(alive.values())


def _unhooked(y, known):
    """{storage: bytes} of what the graph behind y saved without passing the saved-tensor hooks: a Python number
    a tensor was multiplied by, kept as a 0-dim float64 tensor."""
    from ..memory.ledger import _node_saved

    out, seen, stack = {}, set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for t in _node_saved(node):
            sid = storage_id(t)
            if sid is not None and sid not in known:
                out[sid] = storage_bytes(t)
        stack += [n for n, _ in node.next_functions]
    return out


_MEASURED = {}  # (module shape, seq_len, batch, dtypes) -> bytes: the fake run depends on nothing else


def mixer_saved_bytes(mixer, seq_len, batch, dtype, compute_dtype=None):
    """Bytes `mixer`'s own forward keeps for backward (distinct storages, its input and parameters excluded) for
    a [batch, seq_len, hidden] input of `dtype`, under autocast to `compute_dtype` where that differs; found by
    running it on fake tensors, remembered per module shape."""
    compute_dtype = compute_dtype or dtype
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in mixer.named_parameters())
    key = (type(mixer), params, seq_len, batch, dtype, compute_dtype)
    if key not in _MEASURED:
        _MEASURED[key] = _run_fake(mixer, seq_len, batch, dtype, compute_dtype)
    return _MEASURED[key]


# --- The shape reader.

class _AttentionView:
    """What config_shape reads of a layer's attention, for a layer holding a mixer instead."""

    sliding_window = None

    def __init__(self, config):
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _LayerView:
    def __init__(self, layer, config):
        self.self_attn = getattr(layer, "self_attn", None) or _AttentionView(config)
        self.mlp = layer.mlp


def hybrid_shape(layer, config, spec):
    """LayerShape fields of a hybrid layer: its MLP's (a gated MLP, or memory.MoE through moe_shape), and either
    its gated attention with per-head q/k norms (qk_norm, attn_gate) or its kept mixer (memory.Mixer)."""
    view = _LayerView(layer, config)
    fields = moe_shape(view, config, spec) if spec.moe is not None else config_shape(view, config, spec)
    mixer = getattr(layer, next(c for c, role in spec.children if role == "mixer"), None)
    if mixer is None:
        return {**fields, "qk_norm": True, "attn_gate": True}
    fields.pop("qk_norm", None)
    return {**fields, "mixer": Mixer(type(mixer).__name__, functools.partial(mixer_saved_bytes, mixer))}
