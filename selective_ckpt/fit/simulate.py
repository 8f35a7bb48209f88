"""One training step simulated on fake tensors: the bytes each phase of it holds, found by the code that trains.

The model (transformers' own, or converted by selective_ckpt in a recompute mode) is built at full width on
the meta device and materialised as FakeTensors (torch's FakeTensorMode: shapes and dtypes, no memory, no
arithmetic); LoRA adapters come from PEFT, QLoRA's 4-bit bases from a stand-in that allocates what
bitsandbytes' Linear4bit allocates. The step runs as Trainer runs it (forward with labels under autocast when
asked, backward, AdamW's step, gradients set to None) after an optimizer step on zero gradients has made
the optimizer state. A
dispatch mode counts every op output's storage from the op that makes it until it is freed, so what is held
at any moment is known to the byte: on the CPU, the allocator measures the same (tests/fit/test_fit.py).

Markers split the step into phases: each decoder layer's forward, the head and loss, the loss backward, each
decoder layer's backward (from the gradient of its output on), the optimizer step. fit/arithmetic.py extends
a 1- and a 2-layer simulation to L layers phase by phase.
"""

import contextlib
import dataclasses
import gc
import math
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import compat
from ..storages import storage_id

QLORA_BLOCK = 64  # NF4 block size: one float32 absmax per 64 weights (no double quantization)
QLORA_COMPUTE = torch.bfloat16  # bnb_4bit_compute_dtype of the QLoRA recipe


@dataclasses.dataclass
class Step:
    """What one simulated step holds, in bytes. `weights`: parameters, buffers and quantization states;
    `state`: AdamW's; `grads`: the trained parameters' gradients; `phases`: phase -> (held at its start, most
    held during it) over weights and state; `forward_end`: held when the forward has returned the loss."""

    weights: int
    state: int
    grads: int
    phases: dict
    forward_end: int


class _Held(TorchDispatchMode):
    """Bytes of the op outputs alive at once, per phase: storages in `known` (parameters, buffers, optimizer
    state, the batch) are left out; a storage counts from the op that makes it until it is freed. `recorder`:
    shown each counted storage as it is made (`alloc(func, t, nbytes, phase, key)`) and freed (`free(key,
    phase)`)."""

    def __init__(self, known, recorder=None):
        super().__init__()
        self.known, self.live, self.current, self.recorder = known, {}, 0, recorder
        self.phase, self.phases, self.backward = "embedding", {"embedding": [0, 0]}, False

    def mark(self, phase):
        self.phase = phase
        self.phases.setdefault(phase, [self.current, self.current])

    def _free(self, key):
        self.current -= self.live.pop(key, 0)
        if self.recorder is not None:
            self.recorder.free(key, self.phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_id(t)
            if key is None or key in self.known or key in self.live:
                continue
            st = t.untyped_storage()
            self.live[key] = st.nbytes()
            self.current += st.nbytes()
            entry = self.phases[self.phase]
            entry[1] = max(entry[1], self.current)
            weakref.finalize(st, self._free, key)
            if self.recorder is not None:
                self.recorder.alloc(func, t, st.nbytes(), self.phase, key)
        return out


class Linear4bit(nn.Linear):
    """Stand-in for bitsandbytes' Linear4bit (NF4, bf16 compute) on fake tensors, where its Params4bit cannot
    exist: the packed weight (uint8, two weights a byte) and one float32 absmax per 64 weights; forward casts
    its input to the compute dtype, dequantizes the weight (a transient of out x in elements), multiplies and
    casts the output back, keeping nothing of its input; backward dequantizes again for the input's gradient.
    Named as bitsandbytes names it, so PEFT and convert() treat it as theirs."""

    def __init__(self, in_features, out_features, bias):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        n = in_features * out_features
        self.weight = nn.Parameter(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8), requires_grad=False)
        self.register_buffer("absmax", torch.empty(math.ceil(n / QLORA_BLOCK), dtype=torch.float32))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.compute_dtype = QLORA_COMPUTE

    def forward(self, x):
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        shape = (self.out_features, self.in_features)
        return _Matmul4bit.apply(x.to(self.compute_dtype), self.weight, shape, bias).to(x.dtype)


    def fused_base(self):
        """What the fused layout's nodes compute for this base (models/fused_layer.py, lora_fusion's bases): the
        same casts and the dequantized transient each way, without autograd; None with a bias (as for
        bitsandbytes' own: the layer then runs the generic path)."""
        return _FusedStandIn(self) if self.bias is None else None


class _FusedStandIn:
    __slots__ = ("module",)

    def __init__(self, module):
        self.module = module

    def forward(self, x):
        m = self.module
        xc = x.to(m.compute_dtype)
        return nn.functional.linear(xc, xc.new_empty((m.out_features, m.in_features))).to(x.dtype)

    def input_grad(self, g2, dtype):
        m = self.module
        g = g2.to(m.compute_dtype)
        return (g @ g.new_empty((m.out_features, m.in_features))).to(dtype)


class _Matmul4bit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, shape, bias):
        ctx.shape = shape
        return nn.functional.linear(x, x.new_empty(shape), bias)  # the dequantized weight lives for the product

    @staticmethod
    def backward(ctx, grad):
        return grad @ grad.new_empty(ctx.shape), None, None, None


def quantize(model):
    """Replaces every Linear (and GPT-2's Conv1D) of `model` but its output head by the 4-bit stand-in (what
    transformers' BitsAndBytesConfig(load_in_4bit=True) quantizes), then freezes every parameter and keeps them
    in float32, as peft's prepare_model_for_kbit_training does."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child is head:
                continue
            if type(child) is nn.Linear:
                setattr(module, child_name, Linear4bit(child.in_features, child.out_features, child.bias))
            elif type(child) is Conv1D:  # GPT-2's, weight [in, out]
                setattr(module, child_name, Linear4bit(child.weight.shape[0], child.nf, child.bias))
    for p in model.parameters():
        p.requires_grad_(False)
        if p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
    for m in model.modules():  # bitsandbytes casts a bias to the compute dtype in place at its first forward
        if isinstance(m, Linear4bit) and m.bias is not None:
            m.bias.data = m.bias.data.to(m.compute_dtype)


def build(config, num_layers, form):
    """transformers' causal LM of `config` with `num_layers` decoder layers in `form` (the weights' dtype;
    LoRA from PEFT on the form's targets, over 4-bit stand-ins for QLoRA), materialised as fake CPU tensors:
    call it under FakeTensorMode. Attention is the one the config names, else transformers' default for the type."""
    from transformers import AutoModelForCausalLM

    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_hidden_layers = num_layers
    # (a config whose layer_types follow num_hidden_layers, a property without a setter, has them already: Falcon-H1)
    if getattr(cfg, "layer_types", None) is not None and len(cfg.layer_types) != num_layers:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    attention = compat.requested_attention_implementation(config)
    compat.set_requested_attention_implementation(cfg, None)  # transformers picks its default for the model type
    # mixture-of-experts layers run the experts implementation the config names, else "grouped_mm" (what
    # from_pretrained picks where torch has grouped matmuls)
    experts = compat.requested_experts_implementation(config) or "grouped_mm"
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # built on the meta device (no memory), then materialised as fake tensors at once
    with unset_fake_temporarily(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=form.weights)
        if form.kind == "qlora":
            quantize(model)
        if form.kind != "full":
            model = with_lora(model, form)
    model = model.to_empty(device="cpu")
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    if attention is not None:  # the one the config names, set as a user sets it on a built model
        compat.set_attention_implementation(root.config, attention)
    if compat.names_experts_implementation(root.config):
        compat.set_experts_implementation(root.config, experts)
    return model.train()


def with_lora(model, form):
    """`model` frozen under PEFT LoRA adapters of the form's rank on those of its targets the model has (alpha
    twice the rank, the form's dropout); a ValueError naming `targets` when it has none of them."""
    from peft import LoraConfig, get_peft_model

    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = [t for t in form.targets if t in present]
    if not targets:
        raise ValueError(f"targets: none of {form.targets} is a module of model type {model.config.model_type!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    return get_peft_model(model, LoraConfig(r=form.rank, lora_alpha=2 * form.rank, target_modules=targets,
                                            lora_dropout=form.lora_dropout, fan_in_fan_out=_conv1d_targets(model,
                                                                                                          targets)))


def _conv1d_targets(model, targets):
    """Whether the targets are transformers' Conv1D (GPT-2's, weights stored transposed): PEFT's fan_in_fan_out."""
    from transformers.pytorch_utils import Conv1D

    return any(isinstance(m, Conv1D) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets)


def checkpointing(model, on):
    """Switches transformers' gradient checkpointing of every decoder layer (non-reentrant, as
    Trainer(gradient_checkpointing=True) with use_reentrant=False runs it) on or off."""
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not on:
        if hasattr(root, "activation_checkpointing_disable"):  # the older name warns where this one exists
            root.activation_checkpointing_disable()
        else:
            root.gradient_checkpointing_disable()
    elif hasattr(root, "activation_checkpointing_enable"):  # the older name warns where this one exists
        root.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        root.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _even_eager_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' "eager" experts forward (the routing mask, then per expert its rows gathered, gate_up,
    act(gate) * up, down, the routing weight, added into the output), with the routed rows split evenly between
    the experts: fake tensors hold no index to split them by. Experts stored transposed ([in, out], multiplied as
    x @ w), with biases or gated their own way (gpt-oss: interleaved gate and up, clamped) run as their class's own
    eager loop does: x @ w + b and the class's gating method."""
    own_layout = getattr(self, "is_transposed", False) or getattr(self, "has_bias", False) or \
        compat.has_own_expert_gating(self)
    final = torch.zeros_like(hidden_states)
    tokens, top_k = top_k_index.shape
    with torch.no_grad():
        torch.empty((self.num_experts + 1, top_k, tokens), dtype=torch.long)  # the one-hot routing mask
    from ..models.moe import even_counts

    for e, count in enumerate(even_counts(tokens * top_k, self.num_experts)):
        if not count:
            continue
        with torch.no_grad():
            top_k_pos, token_idx = torch.zeros(count, dtype=torch.long), torch.zeros(count, dtype=torch.long)
        if own_layout:
            rows = _own_layout_expert(self, hidden_states[token_idx], e)
        else:
            gate, up = nn.functional.linear(hidden_states[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            rows = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
        rows = rows * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, rows.to(final.dtype))
    return final


def _own_layout_expert(self, x, e):
    """Expert e's rows of an experts module stored its own way (transposed, biased, its own gating), as its eager
    loop computes them."""
    def project(x, w, bias):
        y = x @ w if self.is_transposed else nn.functional.linear(x, w)
        return y + getattr(self, bias)[e] if self.has_bias else y

    return project(compat.expert_gate(self)(self, project(x, self.gate_up_proj[e], "gate_up_proj_bias")),
                   self.down_proj[e], "down_proj_bias")


def even_routing(model):
    """transformers' "eager" experts of `model` run as _even_eager_experts (an instance forward per experts
    module; its "grouped_mm" and "batched_mm" need no split: they run as they are); our converted experts split
    their rows evenly too (models.moe.even_routing, entered by the caller)."""
    from types import MethodType

    for m in model.modules():
        # (experts without a config run one implementation of their own, Llama 4's every expert on every token)
        if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "num_experts") and \
                hasattr(m, "config") and compat.experts_implementation(m.config) == "eager":
            m.forward = MethodType(_even_eager_experts, m)


class _GroupedMm(torch.autograd.Function):
    """torch's grouped matmul on fake tensors, whose fake kernel takes bf16 only: the [rows, out] output, and
    kept for backward what torch's derivative keeps (the offsets, and each operand only when the other one's
    gradient is asked for: a frozen expert weight keeps no input), the gradients autograd asks for."""

    @staticmethod
    def forward(ctx, a, b, offs, out_dtype):
        need_a, need_b = ctx.needs_input_grad[:2]
        ctx.shapes = (a.shape, a.dtype, b.shape, b.dtype)
        ctx.save_for_backward(a if need_b else None, b if need_a else None, offs if need_a or need_b else None)
        return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype or a.dtype)

    @staticmethod
    def backward(ctx, grad):
        need_a, need_b = ctx.needs_input_grad[:2]
        a_shape, a_dtype, b_shape, b_dtype = ctx.shapes
        return (grad.new_empty(a_shape, dtype=a_dtype) if need_a else None,
                grad.new_empty(b_shape, dtype=b_dtype) if need_b else None, None, None)


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None, **kwargs):
    out = _GroupedMm.apply(a, b, offs, out_dtype)
    return out if bias is None else out + bias


@contextlib.contextmanager
def grouped_matmuls():
    """torch's grouped matmuls (torch.nn.functional.grouped_mm, torch._grouped_mm) run as _GroupedMm."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in ((torch.nn.functional, "grouped_mm"),
                                                                     (torch, "_grouped_mm")) if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, _grouped_mm)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def decoder_layers(model):
    """The decoder layers of a transformers model, in order (transformers' GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _first_tensor(out):
    return next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)


@contextlib.contextmanager
def _markers(model, held):
    """Marks each decoder layer's forward and backward and the head, through hooks that keep no tensor."""
    layers = decoder_layers(model)
    handles = []

    def backward_of(i):
        def hook(grad):
            held.backward = True
            held.mark(("backward", i))
        return hook

    def pre(i):
        def hook(module, args):
            if not held.backward:  # a checkpointed layer's forward runs again in backward
                held.mark(("forward", i))
        return hook

    def post(i):
        def hook(module, args, out):
            t = _first_tensor(out)
            if held.backward or t is None:
                return
            if t.requires_grad:
                t.register_hook(backward_of(i))
            if i == len(layers) - 1:
                held.mark("head")
        return hook

    for i, layer in enumerate(layers):
        handles += [layer.register_forward_pre_hook(pre(i)), layer.register_forward_hook(post(i))]
    try:
        yield layers
    finally:
        for h in handles:
            h.remove()


def _storages(tensors):
    seen = {}
    for t in tensors:
        key = storage_id(t)
        if key is not None:
            seen[key] = t.untyped_storage().nbytes()
    return seen


def run_step(model, batch, seq_len, autocast=None, recorder=None):
    """Simulates one steady-state step of `model` (on fake tensors) on a [batch, seq_len] batch with labels, the
    optimizer state made by a step on zero gradients first; returns its Step. `autocast`: the dtype of
    torch.autocast("cpu") around forward and loss, or None. `recorder`: shown every counted storage (_Held), its
    `watch(model)` (a context manager) entered around the step (fit/growth.py's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    ids = torch.zeros((batch, seq_len), dtype=torch.long)

    def forward():
        with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
            return model(input_ids=ids, labels=ids).loss

    for p in params:  # the optimizer state, as a first step leaves it (no first forward: it costs time only)
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    weights = _storages([*model.parameters(), *model.buffers()])
    state = _storages(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    held = _Held(set(weights) | set(state) | set(_storages([ids])), recorder)
    # What reference cycles hold is held until a collection: none runs inside the step, as in CPU tests. No
    # collection before it either: garbage of earlier steps is not freed inside it with collections off, and a
    # full collection of a process that imported transformers costs ~0.3 s, a quarter of the CLI's time.
    gc.disable()
    try:
        with held, _markers(model, held), \
                recorder.watch(model) if recorder is not None else contextlib.nullcontext():
            loss = forward()
            held.mark("loss backward")
            forward_end = held.current
            loss.backward()
            del loss
            held.mark("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        gc.enable()
    grads = sum(p.numel() * p.element_size() for p in params)
    return Step(sum(weights.values()), sum(state.values()), grads, {k: tuple(v) for k, v in held.phases.items()},
                forward_end)
