"""transformers' own model, built on the meta device at full width (no memory, no compute), and what its
forward keeps for backward, counted by distinct storage under saved-tensor hooks.

Attention runs as the fused SDPA kernels do on GPU and CPU (flash / memory-efficient): they keep q, k, v as
passed, the output and a float32 logsumexp per row, never the S x S probabilities; the meta device's own
SDPA would take the math path and count those. A stand-in with exactly that saved set replaces it here.

Under autocast the forward runs on fake CPU tensors (the meta device has no autocast), so what is kept is
what autocast makes of it: each Linear's cast weight and cast input, the residual stream in the weights'
dtype, attention's inputs cast to the autocast dtype.
"""

import contextlib
import copy
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_ATTN = "fit_meta_sdpa"


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        b, hq, s, _ = q.shape
        lse = q.new_empty((b, hq, s), dtype=torch.float32)
        # laid out [B, S, H, D] as the fused kernels write it: the caller's transpose(1, 2).contiguous() is free
        out = q.new_empty((b, s, hq, v.shape[-1])).transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if torch.is_autocast_enabled("cpu"):  # SDPA is on autocast's lower-precision list: it reads casts
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (x.to(dtype) for x in (query, key, value))
    out = _FusedAttention.apply(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def _register():
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTN, _attention)


def build(config, num_layers, form):
    """transformers' causal LM of `config` with `num_layers` layers on the meta device, in `form`'s weight
    dtype, with LoRA adapters for a LoRA form (a QLoRA form's bases stay plain Linears here)."""
    from transformers import AutoModelForCausalLM

    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_hidden_layers = num_layers
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers] or None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=form.weights)
    model.train()
    if form.kind != "full":
        from peft import LoraConfig, get_peft_model

        present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        targets = [t for t in form.targets if t in present]
        if not targets:
            raise ValueError(f"targets: none of {form.targets} is a module of model type {cfg.model_type!r}")
        for p in model.parameters():
            p.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=form.rank, lora_alpha=2 * form.rank, target_modules=targets,
                                                 lora_dropout=0.0))
    return model


def kept_bytes(model, tokens_shape, autocast=None):
    """Bytes the forward (with labels: the loss too) keeps for backward, parameters, buffers and the
    batch itself excluded; under `autocast` (a dtype, or None) as torch.autocast("cpu") runs it."""
    return footprint(model, tokens_shape, autocast)[0]


def footprint(model, tokens_shape, autocast=None):
    """(kept, forward peak): what the forward keeps for backward (kept_bytes) and the most its op outputs
    hold at once while it runs (the loss head's logits and their float32 upcast, the KV cache transformers
    fills when config.use_cache is on, ...), both without parameters, buffers and the batch."""
    if autocast is None:
        return _footprint(model, tokens_shape, "meta", contextlib.nullcontext())
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = copy.deepcopy(model)  # the meta model stays as it is for the next call
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        return _footprint(model, tokens_shape, "cpu", torch.autocast("cpu", dtype=autocast))


class _Live(TorchDispatchMode):
    """Peak bytes of the op outputs alive at once, storages in `known` (parameters, the batch) left out."""

    def __init__(self, known):
        super().__init__()
        self.known, self.live, self.current, self.peak = known, {}, 0, 0

    def _free(self, key):
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st._cdata in self.known or st._cdata in self.live:
                continue
            self.live[st._cdata] = st.nbytes()
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._free, st._cdata)
        return out


def _footprint(model, tokens_shape, device, autocast):
    _register()
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    root.config._attn_implementation = _ATTN
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    params |= {b.untyped_storage()._cdata for b in model.buffers()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    ids = torch.zeros(tokens_shape, dtype=torch.long, device=device)
    params.add(ids.untyped_storage()._cdata)  # the batch exists before the step
    live = _Live(params)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast, live:
        model(input_ids=ids, labels=ids)
    return sum(seen.values()), live.peak
