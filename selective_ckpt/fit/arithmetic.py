"""The step's peak, by part, from a config: weights, gradients, AdamW state, activations kept per layer,
the loss head, the largest transient of one layer's backward, and the caching allocator's share.

Memory model (one steady-state step: forward, backward, optimizer step, with the optimizer state already
allocated and gradients set to None before the step):

    peak = weights + optimizer state + max(forward end, first layer's backward, optimizer step)
    forward end          = L * kept per layer + kept outside the layers (loss head included) + head transient
    loss backward        = the same + transformers' t x V float32 loss gradients (ours formed them in forward)
    first layer backward = L * kept per layer + head gradients + one layer's backward transient
    last layer backward  = all gradients + one layer's backward transient
    optimizer step       = all gradients + AdamW's temporaries (two of the largest trained tensor)

transformers' layers are counted by a forward of the model on the meta device (meta.py), ours by
memory.estimate through the family's spec (the same numbers the ledger tests hold the layers to).
"""

import dataclasses
import functools
import math

import torch

from ..memory.estimate import LoRA, estimate, loss_head_estimate
from ..validation import check_positive_int
from . import meta
from .forms import TrainingForm

VARIANTS = ("transformers", "transformers + gradient checkpointing", "ours none", "ours selective", "ours full",
            "ours plan")
QLORA_BLOCK = 64  # NF4 block size: one float32 absmax per 64 weights (no double quantization)
ALLOCATOR_SHARE = 0.05  # the caching allocator's rounding and fragmentation, as a share of the peak

NOT_MODELLED = (
    "CUDA context and kernel workspaces (cuBLAS, the fused attention's scratch): outside the caching allocator",
    "the caching allocator's fragmentation beyond a flat 5 % share",
    "mixture-of-experts routing (data-dependent expert loads): such models raise",
    "data-loader, pinned and host memory; distributed (ZeRO/FSDP) sharding",
    "a masked attention call on CPU (padding, sliding windows) takes SDPA's math kernel, which keeps S x S "
    "probabilities; the fused kernels' saved set (GPU) is what is counted",
    "QLoRA bases are NF4 with one float32 absmax per 64 weights (no double quantization)",
)


def _size(dtype):
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass
class Variant:
    name: str
    kept_per_layer: int
    kept_outside: int
    head_transient: int
    layer_transient: int
    forward_transient: int = 0  # the last layer's forward over what the layers keep, KV cache included
    peak: int = 0
    phases: dict = dataclasses.field(default_factory=dict)
    modes: list = None
    error: str = None


@dataclasses.dataclass
class Fit:
    """The projection: `parts` (bytes by part), `variants` (name -> Variant with its peak), `max_context`
    (name -> longest context per sample that fits, or 0), `not_modelled` (what the model leaves out)."""

    model_type: str
    form: TrainingForm
    batch: int
    seq_len: int
    gpu_bytes: int
    num_layers: int
    parts: dict
    variants: dict
    max_context: dict = dataclasses.field(default_factory=dict)
    not_modelled: tuple = NOT_MODELLED

    def fits(self, name):
        v = self.variants[name]
        return v.error is None and v.peak * (1 + ALLOCATOR_SHARE) <= self.gpu_bytes


class _Model:
    """What does not depend on the context: parameters by part, the layer's shape for our estimate."""

    def __init__(self, config, form):
        if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
            raise ValueError(f"config: model type {config.model_type!r} is a mixture of experts "
                             "(num_local_experts / num_experts); its routing is data-dependent and not modelled")
        self.config, self.form = config, form
        self._kept = {}
        self.num_layers = config.num_hidden_layers
        self.models = {n: meta.build(config, n, form) for n in (1, 2)}
        w = {n: self._params(m) for n, m in self.models.items()}
        per_layer = {k: w[2][k] - w[1][k] for k in w[1]}
        outside = {k: w[1][k] - per_layer[k] for k in w[1]}
        L = self.num_layers
        self.weights = outside["weights"] + L * per_layer["weights"]
        self.grads = outside["grads"] + L * per_layer["grads"]
        self.grad_tensors = outside["tensors"] + L * per_layer["tensors"]
        self.head_grads = self._head_grad_bytes()
        self.largest_trained = w[1]["largest"]
        self.optimizer = 2 * self.grads + 4 * self.grad_tensors  # exp_avg, exp_avg_sq; a float32 step each

    def _params(self, model):
        out = {"weights": 0, "grads": 0, "tensors": 0, "largest": 0}
        # bitsandbytes quantizes every Linear but the output head; embeddings and norms stay float
        kept_float = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        kept_float |= {id(p) for p in self._root(model).get_output_embeddings().parameters()}
        for name, p in model.named_parameters():
            n = p.numel() * p.element_size()
            if self.form.kind == "qlora" and p.dim() == 2 and id(p) not in kept_float and "lora_" not in name:
                n = p.numel() // 2 + math.ceil(p.numel() / QLORA_BLOCK) * 4
            out["weights"] += n
            if p.requires_grad:
                out["grads"] += n
                out["tensors"] += 1
                out["largest"] = max(out["largest"], n)
        return out

    def _head_grad_bytes(self):
        head = self._root(self.models[1]).get_output_embeddings()
        return sum(p.numel() * p.element_size() for p in head.parameters() if p.requires_grad)

    @staticmethod
    def _root(model):
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def hf_kept(self, batch, seq_len):
        """(kept per layer, kept outside the layers, forward transient per layer, forward transient outside)
        of transformers' model: a 2-layer minus a 1-layer meta forward. The transient is what the forward's
        op outputs hold at its peak over what it keeps (the loss head's logits, the KV cache)."""
        if (batch, seq_len) in self._kept:
            return self._kept[batch, seq_len]
        autocast = self.form.autocast if self.form.compute != self.form.weights else None
        k1, p1 = meta.footprint(self.models[1], (batch, seq_len), autocast)
        k2, p2 = meta.footprint(self.models[2], (batch, seq_len), autocast)
        t1, t2 = p1 - k1, p2 - k2
        self._kept[batch, seq_len] = k2 - k1, 2 * k1 - k2, t2 - t1, 2 * t1 - t2
        return self._kept[batch, seq_len]

    def hf_kept_linear(self, batch, seq_len):
        # every tensor transformers keeps is proportional to the sequence (fused attention): two meta
        # forwards give the line, any context is read from it
        s0 = 64
        a0 = self.hf_kept(batch, s0)
        a1 = self.hf_kept(batch, 2 * s0)
        return tuple(x0 + (x1 - x0) * (seq_len - s0) // s0 for x0, x1 in zip(a0, a1))

    def projections(self):
        """(name, fan in, what it reads: "norm", "product" or None, LoRA-adapted) of each Linear of one layer."""
        from ..models.hf import modules_of

        layer = modules_of(self._root(self.models[1]), self.spec().layer)[0][1]
        out = []
        for name, m in layer.named_modules():
            if not isinstance(m, torch.nn.Linear) or ".lora_" in name:
                continue
            lora = name.endswith(".base_layer")  # PEFT wraps an adapted Linear as its base_layer
            name = name[: -len(".base_layer")] if lora else name
            leaf = name.rsplit(".", 1)[-1]
            if leaf in _OUTPUT_PROJECTIONS:
                reads = "product" if ".mlp" in "." + name else None
            else:
                reads = "norm"
            out.append((name, m.in_features, reads, lora))
        return out

    @functools.cached_property
    def autocast_weight_copies(self):
        """autocast's cached 16-bit copies of the trained float32 weights, made once per forward."""
        if self.form.autocast is None or self.form.compute == self.form.weights:
            return 0
        e = _size(self.form.compute)
        per = {n: sum(m.weight.numel() for m in self._root(self.models[n]).modules()
                      if isinstance(m, torch.nn.Linear) and m.weight.requires_grad) for n in (1, 2)}
        return e * (per[1] + (self.num_layers - 1) * (per[2] - per[1]))

    def cache_bytes(self, batch, seq_len):
        """transformers' KV cache after a forward with config.use_cache on (training does not turn it off):
        every layer's rotated keys and values, which ours' attention keeps copies of, not these."""
        if not getattr(self.config, "use_cache", False):
            return 0
        shape, _ = self.shape
        d = shape["hidden_dim"] // shape["num_heads"]
        kv = (shape.get("num_kv_heads") or shape["num_heads"]) * d
        # the keys after RoPE are in the residual stream's dtype (float32 tables), the values in the compute dtype
        return self.num_layers * batch * seq_len * kv * (_size(self.form.weights) + _size(self.form.compute))

    def spec(self):
        from ..models import model_specs

        spec = model_specs().get(self.config.model_type)
        if spec is None:
            raise ValueError(f"config: model type {self.config.model_type!r} is not converted by selective_ckpt "
                             f"(converted: {', '.join(sorted(model_specs()))})")
        return spec

    @functools.cached_property
    def shape(self):
        from ..models.hf import modules_of

        spec = self.spec()
        root = self._root(self.models[1])
        layer = modules_of(root, spec.layer)[0][1]
        shape = dict(spec.shape(layer, root.config, spec))
        shape.pop("dtype", None)
        ranks = {}
        if self.form.kind != "full":
            for name, m in layer.named_modules():
                if hasattr(m, "lora_A"):
                    ranks[name] = self.form.rank
        return shape, ranks

    def ours_layer(self, batch, seq_len, mode):
        shape, ranks = self.shape
        f = self.form
        residual = f.weights
        compute = f.compute
        mlp = residual if f.kind == "qlora" else compute
        lora = LoRA(ranks, f.autocast or f.weights, 0.0) if ranks else None
        return estimate(seq_len=seq_len, batch=batch, recompute=mode, dtype=compute, residual_dtype=residual,
                        mlp_dtype=mlp, lora=lora, **shape)

    def ours_outside(self, batch, seq_len):
        """(kept, head transient): the final norm's input and statistics and the fused loss head."""
        t, h = batch * seq_len, self.config.hidden_size
        head = self._root(self.models[1]).get_output_embeddings()
        parts = loss_head_estimate(t, self.config.vocab_size, h, self.form.weights,
                                   weight_grad=head.weight.requires_grad, bias=head.bias is not None,
                                   breakdown=True)
        # dweight formed in forward is the head's gradient: counted with the gradients, not here
        kept = parts["dhidden"] + t * h * _size(self.form.weights) + t * 4
        return kept, parts["chunk"] + parts["accumulator"]


def _layer_backward_transient(model, batch, seq_len, converted):
    """The largest transient of one layer's backward, t tokens, h hidden, f the MLP width, e bytes per element.

    e is the weights' element size (under autocast the residual stream's gradients stay in it).
    transformers: the gradients of the MLP's largest intermediates while they are formed (d(gate), d(up),
    d(act(gate) * up): 3 t f) and two of the residual stream's (2 t h). Ours: the rebuilt outputs and their
    gradients inside the fused backward kernels, 7 t h + 2 t f, plus 5 t (H + Hkv) D with q/k norms, as the
    CPU allocator measures them (calibrated there; tests/test_fit.py holds the whole step to 5 %).
    """
    t = batch * seq_len
    c = model.config
    h = c.hidden_size
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * h
    e = _size(model.form.weights)  # under autocast the residual stream's gradients stay in the weights' dtype
    if not converted:
        return (3 * ffn + 2 * h) * t * e
    shape, _ = model.shape
    qk = 0
    if model.spec().qk_norm:  # the q/k norms' rebuilt outputs and their gradients, 5 (q + k widths)
        d = shape["hidden_dim"] // shape["num_heads"]
        qk = 5 * (shape["num_heads"] + (shape.get("num_kv_heads") or shape["num_heads"])) * d
    return (7 * h + 2 * ffn + qk) * t * e


_OUTPUT_PROJECTIONS = ("o_proj", "dense", "c_proj", "out_proj", "down_proj", "dense_4h_to_h", "fc2")


def _layer_forward_transient(model, batch, seq_len):
    """What the step holds at the end of the last layer's forward over what the layers keep.

    The layer's registered outputs (its norm outputs and the MLP product: the "none" set over "selective")
    live until its forward returns, and so does every cast of them a projection computes in another dtype
    (autocast's 16-bit copy per q/k/v/gate/up/down Linear, a 4-bit base's cast to its compute dtype, PEFT's
    cast of a 16-bit input to the adapter's float32 and autocast's back); then the MLP output (and its
    upcast to the residual stream) and the KV cache transformers fills. Outside the layers: the embedding
    output and the rotary tables; autocast's cached copies of the trained weights live until it exits.
    """
    t, h = batch * seq_len, model.config.hidden_size
    f = model.form
    e_r, e_c = _size(f.weights), _size(f.compute)
    quantized = f.kind == "qlora"
    e_mlp = e_r if quantized else e_c
    e_base = 2 if quantized else e_c  # bitsandbytes computes in bnb_4bit_compute_dtype (bfloat16 here)
    held = model.ours_layer(batch, seq_len, "none") - model.ours_layer(batch, seq_len, "selective")
    casts = 0
    for name, fan_in, reads, lora in model.projections():
        if reads is None:
            continue
        e_in = e_r if reads == "norm" else e_mlp
        if e_base != e_in:
            casts += t * fan_in * e_base
        if lora:
            e_lora = e_c if f.autocast is not None else e_r
            if e_in != e_r:  # PEFT casts the input to the adapter's (float32) dtype
                casts += t * fan_in * e_r
            if e_lora != e_r:
                casts += t * fan_in * e_lora
    out = t * h * e_mlp + (t * h * e_r if e_mlp != e_r else 0)
    shape, _ = model.shape
    d = shape["hidden_dim"] // shape["num_heads"]
    outside = t * h * e_r + 2 * seq_len * d * 4 + seq_len * 8 + model.autocast_weight_copies
    return held + casts + out + model.cache_bytes(batch, seq_len) + outside


def _head_backward(model, batch, seq_len):
    """transformers' loss backward: the float32 gradient of the upcast logits and one more t x V float32
    buffer (log-softmax's and the upcast's gradients), over what forward kept."""
    return 2 * batch * seq_len * model.config.vocab_size * 4


def _assemble(model, v, head_backward=0):
    L = model.num_layers
    acts = L * v.kept_per_layer + v.kept_outside
    v.phases = {
        "last layer forward": L * v.kept_per_layer + v.forward_transient,
        "forward end": acts + v.head_transient,
        "loss backward": acts + head_backward,
        # the loss head's and the final norm's saved tensors are freed once their backward has run
        "first layer backward": L * v.kept_per_layer + model.head_grads + v.layer_transient,
        "last layer backward": model.grads + v.layer_transient,
        "optimizer step": model.grads + 2 * model.largest_trained,
    }
    v.peak = model.weights + model.optimizer + max(v.phases.values())
    return v


def _variants(model, batch, seq_len, gpu_bytes=None, names=VARIANTS):
    out = {}
    t = batch * seq_len
    e_res = _size(model.form.weights)
    if set(names) & set(VARIANTS[:2]):
        a_hf, o_hf, ta_hf, to_hf = model.hf_kept_linear(batch, seq_len)
        trans = _layer_backward_transient(model, batch, seq_len, False)
        hb = _head_backward(model, batch, seq_len)
        L = model.num_layers
        out[VARIANTS[0]] = _assemble(model, Variant(VARIANTS[0], a_hf, o_hf, to_hf + L * ta_hf, trans), hb)
        # checkpointed layers keep their input; the one re-run in backward keeps a whole layer again; training
        # with checkpointing turns transformers' KV cache off (the per-layer part of the forward's transient)
        out[VARIANTS[1]] = _assemble(model, Variant(VARIANTS[1], t * model.config.hidden_size * e_res, o_hf, to_hf,
                                                    a_hf + trans), hb)
    if not set(names) & set(VARIANTS[2:]):
        return out
    try:
        kept_out, head_t = model.ours_outside(batch, seq_len)
        trans = _layer_backward_transient(model, batch, seq_len, True)
        sel = model.ours_layer(batch, seq_len, "selective")
        fwd = _layer_forward_transient(model, batch, seq_len)
        head_t += model.cache_bytes(batch, seq_len)
        for mode in ("none", "selective", "full"):
            a = model.ours_layer(batch, seq_len, mode)
            name = f"ours {mode}"
            # a "full" layer re-runs its forward in backward, keeping its "selective" set until done
            out[name] = _assemble(model, Variant(name, a, kept_out, head_t, trans + (sel if mode == "full" else 0),
                                                 fwd))
        if "ours plan" in names and gpu_bytes is not None:
            out["ours plan"] = _plan_variant(model, batch, seq_len, gpu_bytes, kept_out, head_t, trans, fwd)
    except ValueError as err:
        for name in VARIANTS[2:]:
            out[name] = Variant(name, 0, 0, 0, 0, error=str(err))
    return out


def _plan_variant(model, batch, seq_len, gpu_bytes, kept_out, head_t, trans, fwd=0):
    """memory.plan's modes per layer for what the budget leaves to the layers' activations after the rest
    of the step (weights, optimizer state, the head and one layer's backward transient)."""
    from ..memory.planner import plan as make_plan

    shape, _ = model.shape
    f = model.form
    usable = gpu_bytes / (1 + ALLOCATOR_SHARE) - model.weights - model.optimizer
    budget = usable - max(kept_out + head_t, model.head_grads + trans)
    v = Variant("ours plan", 0, kept_out, head_t, trans, fwd)
    layer_shape = dict(shape, dtype=f.compute, num_layers=model.num_layers)
    layer_shape.pop("rope_theta", None)
    # the planner counts layers in the compute dtype without LoRA: lower its budget by what ours' own
    # per-layer figures add until the step fits; every layer "full" is the last plan tried, so a plan fits
    # wherever ours full does
    for _ in range(16 if budget > 0 else 0):
        try:
            p = list(make_plan(layer_shape, batch, seq_len, budget))
        except ValueError:
            break
        if _plan_fits(model, v, p, batch, seq_len, trans, gpu_bytes):
            return v
        budget -= v.peak * (1 + ALLOCATOR_SHARE) - gpu_bytes
        if budget <= 0:
            break
    if _plan_fits(model, v, ["full"] * model.num_layers, batch, seq_len, trans, gpu_bytes):
        return v
    v.error = "no per-layer plan fits"
    return v


def _plan_fits(model, v, modes, batch, seq_len, trans, gpu_bytes):
    """Fills `v` with the step of per-layer `modes`; whether it fits in `gpu_bytes`."""
    v.modes = modes
    v.kept_per_layer = sum(model.ours_layer(batch, seq_len, m) for m in modes) / model.num_layers
    v.layer_transient = trans + (model.ours_layer(batch, seq_len, "selective") if "full" in modes else 0)
    _assemble(model, v)
    return v.peak * (1 + ALLOCATOR_SHARE) <= gpu_bytes


def predict(config, batch, seq_len, form=None, names=VARIANTS):
    """{variant name: Variant} (its `peak` and `phases` in bytes) of one step at `batch` x `seq_len`;
    "ours plan" needs a budget (fit) and is left out here."""
    from .configs import load_config

    check_positive_int(batch, "batch")
    check_positive_int(seq_len, "seq_len")
    model = _Model(load_config(config), form if form is not None else TrainingForm())
    return _variants(model, batch, seq_len, names=tuple(n for n in names if n != "ours plan"))


def fit(config, gpu_bytes, batch=1, seq_len="max", form=None):
    """Projects one training step's peak memory for `config` (load_config's input) on a GPU of
    `gpu_bytes`, per variant (VARIANTS), and the longest context per sample that fits each.

    `seq_len`: tokens per sample, or "max" (the report is then at the longest context ours fits with
    "selective"). `form`: a TrainingForm (default: full fine-tune, AdamW, float32).
    """
    from .configs import load_config

    config = load_config(config)
    form = form if form is not None else TrainingForm()
    if not isinstance(form, TrainingForm):
        raise TypeError(f"form must be a TrainingForm, got {type(form).__name__}")
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) or gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be a positive number of bytes, got {gpu_bytes!r}")
    check_positive_int(batch, "batch")
    model = _Model(config, form)
    if model.weights + model.optimizer >= gpu_bytes:
        raise ValueError(f"gpu_bytes: {gpu_bytes} bytes is not more than the weights and optimizer state alone "
                         f"({model.weights + model.optimizer} bytes)")
    limit = getattr(config, "max_position_embeddings", None) or 1 << 20
    max_context = {name: _longest(model, batch, name, gpu_bytes, limit) for name in VARIANTS}
    if seq_len == "max":
        seq_len = max(max_context.values()) or 1
    else:
        check_positive_int(seq_len, "seq_len")
    variants = _variants(model, batch, seq_len, gpu_bytes)
    parts = {"weights": model.weights, "gradients": model.grads, "optimizer state": model.optimizer}
    return Fit(config.model_type, form, batch, seq_len, int(gpu_bytes), model.num_layers, parts, variants,
               max_context)


def _longest(model, batch, name, gpu_bytes, limit):
    """Longest context per sample whose peak (with the allocator's share) fits, 0 if none; peaks grow with it."""
    def ok(s):
        v = _variants(model, batch, s, gpu_bytes, names=(name,))[name]
        return v.error is None and v.peak * (1 + ALLOCATOR_SHARE) <= gpu_bytes

    if not ok(1):
        return 0
    lo, hi = 1, limit
    if ok(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


__all__ = ["ALLOCATOR_SHARE", "Fit", "NOT_MODELLED", "VARIANTS", "Variant", "fit", "predict"]
