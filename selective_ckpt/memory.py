"""Activation memory: what a forward keeps for backward (ledger), what it should keep (estimate),
and which recompute mode each layer can afford under a memory budget (plan).

- `ledger(fn_or_module, *inputs)` runs one forward under saved-tensor hooks and counts the bytes
  kept for backward by distinct storage (views of one buffer count once), parameters and buffers
  excluded. Each saved tensor is attributed to the innermost module running when it was saved, to
  the op that allocated its storage and to its grad_fn. Tensors cached by PyTorch's selective
  checkpointing do not pass through saved-tensor hooks; `sac_context_fn` builds a policy that
  reports them.
- `estimate(...)` gives DESIGN.md's per-layer figure for SelectiveDecoderLayer, to the byte.
- `plan(...)` picks a mode per layer that fits a budget with the least recompute cost.
- `cpu_peak_bytes(fn)` is the CPU peak of what `fn` allocates (allocator events, as CUDA counts);
  `StorageTracker` follows live op outputs only (what custom ops allocate inside is invisible to it).
"""

import contextlib
import dataclasses
import functools
import os
import sys
import weakref
from collections import OrderedDict

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import rng
from .layers import check_heads, check_mode, check_positive_int, ffn_dim

MODES = ("none", "selective", "full")

_DTYPE_NAMES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}


def as_dtype(dtype, name="dtype") -> torch.dtype:
    """A floating torch.dtype from a dtype or a name such as 'bf16' / 'float32'."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    raise TypeError(f"{name} must be a torch floating dtype or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")


def format_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


# ---------------------------------------------------------------------------------------------
# Ledger

@dataclasses.dataclass
class SavedEntry:
    """One distinct storage kept for backward."""

    shape: tuple
    dtype: torch.dtype
    bytes: int  # the storage's size: what stays alive, even when only a view was saved
    module: str  # innermost module running when it was saved
    layer: str  # innermost enclosing decoder layer, or "-" outside any
    op: str  # the op that allocated the storage (aten/custom op name), "input" if it predates the run
    grad_fn: str  # grad_fn class name of the saved tensor ("-" for none)
    views: int = 1  # how many saved tensors share this storage


class LedgerReport:
    """Bytes kept for backward by one forward. `total`, `entries`, `by_layer`, `by_module`, `by_op`."""

    def __init__(self, entries):
        self.entries = list(entries)
        self.total = sum(e.bytes for e in self.entries)

    def _group(self, key):
        out = OrderedDict()
        for e in self.entries:
            out[getattr(e, key)] = out.get(getattr(e, key), 0) + e.bytes
        return out

    @property
    def by_layer(self):
        """Bytes per decoder layer (SelectiveDecoderLayer / EagerDecoderLayer by default), in call order."""
        return self._group("layer")

    @property
    def by_module(self):
        return self._group("module")

    @property
    def by_op(self):
        return self._group("op")

    def table(self) -> str:
        head = ("layer", "module", "op", "grad_fn", "shape", "dtype", "views", "bytes")
        rows = [(e.layer, e.module, e.op, e.grad_fn, "x".join(map(str, e.shape)) or "scalar",
                 str(e.dtype).replace("torch.", ""), str(e.views), str(e.bytes)) for e in self.entries]
        pad = ("",) * (len(head) - 2)
        rows.append(("total", *pad, f"{self.total} ({format_bytes(self.total)})"))
        layers = self.by_layer
        if len(layers) > 1 or "-" not in layers:
            rows += [("",) * len(head)]
            rows += [(f"layer {k}", *pad, f"{v} ({format_bytes(v)})") for k, v in layers.items()]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        last = len(head) - 1
        fmt = lambda r: "  ".join(c.rjust(w) if i == last else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows])

    __str__ = table

    def __repr__(self):
        return f"LedgerReport(total={self.total}, entries={len(self.entries)}, by_layer={dict(self.by_layer)})"


_ACTIVE = []  # the ledgers recording now (innermost last); note_saved reports to the innermost


def _default_layer_types():
    types = []
    for mod, name in (("layers", "SelectiveDecoderLayer"), ("baseline", "EagerDecoderLayer")):
        try:
            module = __import__(f"{__package__}.{mod}", fromlist=[name])
            types.append(getattr(module, name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def _storage_key(t):
    try:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage (subclass, sparse)
        return ("id", id(t)), t.numel() * t.element_size()
    if ptr == 0:  # meta or empty: no address to share
        return ("id", id(t)), nbytes
    return (t.device.type, t.device.index, ptr), nbytes


class _Producers(torch.utils._python_dispatch.TorchDispatchMode):
    """Remembers which op allocated each storage during the ledger's forward (saved LayerNorm
    statistics and custom-op outputs have no grad_fn to name them)."""

    def __init__(self):
        super().__init__()
        self.by_key = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(a)[0] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)[0]
                if key not in inputs:
                    self.by_key[key] = _op_name(func)
        return out


def _op_name(func):
    name = getattr(func, "_schema", None)
    name = name.name if name is not None else getattr(func, "__name__", str(func))
    return name.replace("::", ".")


class _Recorder:
    def __init__(self, root, names_from, layer_types, exclude):
        self.layer_types = tuple(layer_types)
        self.names = {}
        if isinstance(names_from, nn.Module):
            self.names = {id(m): (name or type(names_from).__name__) for name, m in names_from.named_modules()}
        self.counts = {}
        self.stack = []
        self.excluded = set()
        self.seen_modules = set()
        self.entries = OrderedDict()
        self.producers = None
        self.sac_modes = []  # selective-checkpoint caching modes created while recording
        self.keep_alive = []  # saved tensors stay referenced so no storage address is reused mid-run
        for obj in exclude:
            if isinstance(obj, nn.Module):
                self._exclude_module(obj)
            elif isinstance(obj, torch.Tensor):
                self.excluded.add(_storage_key(obj)[0])
            else:
                raise TypeError(f"exclude must hold modules or tensors, got {type(obj).__name__}")
        for m in (root, names_from):
            if isinstance(m, nn.Module):
                self._exclude_module(m)

    def _exclude_module(self, module):
        for t in list(module.parameters()) + list(module.buffers()):
            self.excluded.add(_storage_key(t)[0])

    def name(self, module):
        if id(module) not in self.names:
            cls = type(module).__name__
            self.counts[cls] = self.counts.get(cls, 0) + 1
            self.names[id(module)] = f"{cls}#{self.counts[cls] - 1}"
        return self.names[id(module)]

    def pre_hook(self, module, args):
        if id(module) not in self.seen_modules:
            self.seen_modules.add(id(module))
            self._exclude_module(module)
        self.stack.append(module)

    def post_hook(self, module, args, output):
        # pop the matching frame (robust to a module whose forward raised inside)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is module:
                del self.stack[i:]
                break

    def where(self):
        module = self.name(self.stack[-1]) if self.stack else "-"
        layer = next((self.name(m) for m in reversed(self.stack) if isinstance(m, self.layer_types)), "-")
        return module, layer

    def add(self, t, op=None):
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
            return
        key, nbytes = _storage_key(t)
        if key in self.excluded:
            return
        if key in self.entries:
            self.entries[key].views += 1
            return
        if nbytes == 0:
            return
        fn = t.grad_fn
        grad_fn = type(fn).__name__ if fn is not None else "-"
        if op is None:
            op = self.producers.by_key.get(key) if self.producers is not None else None
            op = op or (grad_fn if fn is not None else "input")
        module, layer = self.where()
        self.entries[key] = SavedEntry(tuple(t.shape), t.dtype, nbytes, module, layer, op, grad_fn)
        self.keep_alive.append(t)

    def pack(self, t):
        self.add(t)
        # A detached alias: returning t itself would make an output and its grad_fn a reference
        # cycle that outlives the ledger until the garbage collector runs. The ledger never runs
        # backward, so the unpacked value only needs the same storage.
        return t.detach()


def ledger(fn_or_module, *inputs, model=None, layer_types=None, exclude=(), track_ops=True, **kwargs) -> LedgerReport:
    """Run `fn_or_module(*inputs, **kwargs)` once with grad enabled and report what it keeps for backward.

    Counting is by distinct storage (`untyped_storage().data_ptr()`), so q, k and v saved as views
    of one qkv buffer count once, at the buffer's size. Parameters and buffers of every module that
    runs are excluded (and anything in `exclude`: modules or tensors). Inputs count when they are
    saved (a LayerNorm keeps its input). Each entry names the innermost module running when the
    tensor was saved (names from `model`, default fn_or_module when it is a module), the innermost
    enclosing layer of `layer_types` (default: SelectiveDecoderLayer and EagerDecoderLayer), the op
    that allocated the storage (found by a dispatch mode; `track_ops=False` skips it and names the
    grad_fn only) and the saved tensor's grad_fn.

    torch.utils.checkpoint(use_reentrant=False) saves its region's inputs through the same hooks,
    so a checkpointed region shows exactly its positional tensor inputs (tensors passed to
    checkpoint as keyword arguments are held by reference, outside the hooks, and not counted);
    what runs inside it is not kept and is not counted. Outputs cached by selective checkpointing
    bypass the hooks: use `sac_context_fn`, which reports them here. The forward's outputs are
    dropped before returning, so the graph and its saved tensors are freed.
    """
    if not callable(fn_or_module):
        raise TypeError(f"fn_or_module must be a module or a callable, got {type(fn_or_module).__name__}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (used for names), got {type(model).__name__}")
    if layer_types is None:
        layer_types = _default_layer_types()
    rec = _Recorder(fn_or_module, model if model is not None else fn_or_module, layer_types, exclude)
    register_pre = nn.modules.module.register_module_forward_pre_hook
    register_post = nn.modules.module.register_module_forward_hook
    handles = [register_pre(rec.pre_hook)]
    try:
        handles.append(register_post(rec.post_hook, always_call=True))
    except TypeError:  # older torch: no always_call
        handles.append(register_post(rec.post_hook))
    _ACTIVE.append(rec)
    try:
        with contextlib.ExitStack() as stack:
            if track_ops:
                rec.producers = stack.enter_context(_Producers())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t))
            out = fn_or_module(*inputs, **kwargs)
            for mode in rec.sac_modes:  # what selective checkpointing cached and the policy did not report
                for leaf in tree_flatten(list(_sac_cache(mode)))[0]:
                    rec.add(getattr(leaf, "val", leaf), op="sac:cached")
            del out
    finally:
        _ACTIVE.remove(rec)
        for h in handles:
            h.remove()
    report = LedgerReport(rec.entries.values())
    rec.keep_alive.clear()
    return report


def note_saved(tensors, op):
    """Report tensors kept for backward outside saved-tensor hooks to the running ledger (if any)."""
    if _ACTIVE:
        for t in tree_flatten(tensors)[0]:
            _ACTIVE[-1].add(t, op=op)


def _matmul_ops():
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


def sac_context_fn(ops=None):
    """A `context_fn` for torch.utils.checkpoint(use_reentrant=False) that saves the outputs of `ops`
    (default: the matmuls mm/addmm/bmm/baddbmm and SDPA kernels) and recomputes everything else,
    PyTorch's selective activation checkpointing. The outputs it caches are reported to a running
    `ledger`, which would not see them otherwise.
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = frozenset(_matmul_ops() if ops is None else ops)

    def policy(ctx, op, *args, **kwargs):
        if op in save:
            if not ctx.is_recompute:
                out = getattr(ctx, "op_output", None)  # not in every torch version
                if out is not None:
                    note_saved(out, f"sac:{op.__name__}")
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        forward_mode, recompute_mode = create_selective_checkpoint_contexts(policy)
        if _ACTIVE:  # without op_output, the ledger reads the cache after the forward instead
            _ACTIVE[-1].sac_modes.append(forward_mode)
        return forward_mode, recompute_mode

    return context_fn


def _sac_cache(mode):
    """The outputs a selective-checkpoint caching mode holds (a private attribute: empty if absent)."""
    storage = getattr(mode, "storage", None)
    if not isinstance(storage, dict):
        return []
    out = []
    for entry in storage.values():
        out += list(entry.values()) if isinstance(entry, dict) else list(entry)
    return out


# ---------------------------------------------------------------------------------------------
# CPU peak memory


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's native logger prints start/stop lines on fd 2; keep them out of the report."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_allocation_deltas(fn):
    """Byte deltas (+ allocation, - free) of every CPU allocation while `fn()` runs, in time order.

    From the profiler (profile_memory=True), which sees allocations inside custom ops and C++
    kernels too. Returns None where the profiler's raw events are not available.
    """
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        raw = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    return [n for _, n in sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")]


def running_peak(deltas):
    """Highest running sum of allocation deltas (0 if it never rises above the start)."""
    current = peak = 0
    for n in deltas:
        current += n
        peak = max(peak, current)
    return peak


def cpu_peak_bytes(fn):
    """Peak of CPU bytes allocated minus freed while `fn()` runs, from the allocator's own events.

    The running sum of `cpu_allocation_deltas` peaks at the figure CUDA's max_memory_allocated gives
    there. Memory freed inside `fn` that was allocated before it is not seen (set gradients to None
    beforehand). Falls back to StorageTracker (op outputs only) where the profiler's raw events are
    not available; `fn` then runs a second time.
    """
    deltas = cpu_allocation_deltas(fn)
    if deltas is not None:
        return running_peak(deltas)
    tracker = StorageTracker()
    with tracker:
        fn()
    return tracker.peak


class StorageTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of live tensor storage allocated while active (op outputs only).

    Every op's outputs are inspected; a storage not shared with the op's inputs (views and in-place
    results share theirs) is counted until it is freed, which a weakref finalizer on the storage
    reports. Storage that existed before (parameters, inputs) is not counted. Temporary buffers an
    op allocates and frees inside itself are invisible: this is the peak of tensors, the figure
    CUDA's max_memory_allocated gives minus allocator rounding and kernel workspaces.
    """

    def __init__(self):
        super().__init__()
        self.live = {}
        self.current = 0
        self.peak = 0

    def _free(self, key):
        n = self.live.pop(key, None)
        if n is not None:
            self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(a)[0] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key, nbytes = _storage_key(t)
            if key in inputs or key in self.live or key[0] == "id":
                continue
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(t.untyped_storage(), self._free, key)
        return out


# ---------------------------------------------------------------------------------------------
# Analytic estimate

def _check_shape(hidden_dim, num_heads, mlp_ratio):
    """The layer's own constructor checks, so estimates exist exactly for layers that can be built."""
    check_heads(hidden_dim, num_heads)
    return ffn_dim(hidden_dim, mlp_ratio)


def estimate(hidden_dim, num_heads, seq_len, batch, dtype, mlp_ratio=4, recompute="selective", breakdown=False,
             dropout=0.0, attn_dropout=0.0):
    """Bytes one SelectiveDecoderLayer keeps for backward (DESIGN.md's memory contract).

    With e = element size, t = s*b tokens, h hidden, a heads, f = the layer's fc1 width and 4-byte
    fp32 statistics (8 for float64 layers):
      selective: t*(h + 3h + h + h + f)*e  [x, q/k/v, o, x1, fc1 out] + a*t*4 [lse] + 2*2*t*4 [LN mean, rstd]
      none:      t*(h + h + 3h + h + h + h + 2f)*e  [adds LN1, LN2 and GELU outputs] + the same lse and stats
      full:      t*h*e  [the layer input only]
    Dropout keeps an 8-byte seed tensor per site that is on (rates `dropout`, `attn_dropout` as in
    the layer, training): attention probabilities, proj output, MLP output; "full" keeps none.
    `breakdown=True` returns a dict of the parts (bytes) instead of the total.
    """
    ffn = _check_shape(hidden_dim, num_heads, mlp_ratio)
    check_positive_int(seq_len, "seq_len")
    check_positive_int(batch, "batch")
    check_mode(recompute)
    dtype = as_dtype(dtype)
    e = torch.empty((), dtype=dtype).element_size()
    acc = 8 if dtype == torch.float64 else 4
    t = seq_len * batch
    h = hidden_dim
    if recompute == "full":
        parts = {"x": t * h * e}
    else:
        parts = {"x": t * h * e, "qkv": 3 * t * h * e, "o": t * h * e, "x1": t * h * e, "fc1_out": t * ffn * e,
                 "lse": num_heads * t * acc, "ln_stats": 2 * 2 * t * acc}
        if recompute == "none":
            parts.update(ln1_out=t * h * e, ln2_out=t * h * e, gelu_out=t * ffn * e)
        rng.threshold(dropout, "dropout")
        rng.threshold(attn_dropout, "attn_dropout")
        sites = (attn_dropout > 0) + 2 * (dropout > 0)
        if sites:
            parts["seeds"] = 8 * sites
    return parts if breakdown else sum(parts.values())


# ---------------------------------------------------------------------------------------------
# Recompute cost model and planner

# Elementwise FLOPs per element (coarse, but only their ratio to the matmuls matters for a plan).
LN_FWD_FLOPS = 8  # mean, variance, normalise, affine
LN_OUT_FLOPS = 4  # (x - mean) * rstd * w + b from the saved statistics
GELU_FLOPS = 8
SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide


def forward_flops(hidden_dim, num_heads, seq_len, batch, mlp_ratio=4, causal=True):
    """FLOPs of one layer forward: the four matmuls, attention (QK^T and PV, halved when causal),
    LayerNorms, softmax, GELU and the two residual adds."""
    ffn = _check_shape(hidden_dim, num_heads, mlp_ratio)
    t, h, s = seq_len * batch, hidden_dim, seq_len
    c = 0.5 if causal else 1.0
    matmul = 2 * t * h * (3 * h + h + 2 * ffn)
    attention = 2 * 2 * t * s * h * c + SOFTMAX_FLOPS * num_heads * t * s * c
    return int(matmul + attention + 2 * LN_FWD_FLOPS * t * h + GELU_FLOPS * t * ffn + 2 * t * h)


def recompute_flops(hidden_dim, num_heads, seq_len, batch, mlp_ratio=4, recompute="selective", causal=True):
    """Extra FLOPs a mode spends in backward, over "none".

    none = 0. selective = re-deriving the two LayerNorm outputs from the saved input and statistics
    and the GELU output from the fc1 output (attention's softmax is rebuilt from logsumexp in every
    mode, since the fused attention never stores it, so it is no extra cost of "selective"). full =
    one more forward of the layer (`forward_flops`).
    """
    ffn = _check_shape(hidden_dim, num_heads, mlp_ratio)
    check_mode(recompute)
    t = seq_len * batch
    if recompute == "none":
        return 0
    if recompute == "selective":
        return 2 * LN_OUT_FLOPS * t * hidden_dim + GELU_FLOPS * t * ffn
    return forward_flops(hidden_dim, num_heads, seq_len, batch, mlp_ratio, causal)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    hidden_dim: int
    num_heads: int
    mlp_ratio: float = 4
    dtype: torch.dtype = torch.float32
    causal: bool = True


class Plan(list):
    """A recompute mode per layer (a list, so `set_recompute(model, plan)` takes it as is), with:

    cost_flops: total extra backward FLOPs; kept_bytes: activations kept for backward;
    peak_bytes: kept_bytes plus the re-run working set (see `plan`); budget_bytes;
    max_batch: {mode: largest batch that fits the budget with every layer in that mode}.
    """

    def __init__(self, modes, cost_flops, kept_bytes, peak_bytes, budget_bytes, max_batch):
        super().__init__(modes)
        self.cost_flops = cost_flops
        self.kept_bytes = kept_bytes
        self.peak_bytes = peak_bytes
        self.budget_bytes = budget_bytes
        self.max_batch = max_batch

    @property
    def modes(self):
        return list(self)

    def __repr__(self):
        return (f"Plan({list(self)}, cost_flops={self.cost_flops}, kept_bytes={self.kept_bytes}, "
                f"peak_bytes={self.peak_bytes}, budget_bytes={self.budget_bytes}, max_batch={self.max_batch})")


def _layer_shape(layer):
    """LayerShape of a SelectiveDecoderLayer from its submodules (ln1, qkv/fc1, parameters)."""
    hidden = layer.ln1.normalized_shape[0]
    heads = getattr(layer, "num_heads", None)
    if heads is None:
        heads = getattr(getattr(layer, "attn", None), "num_heads", None)
    if heads is None:
        raise ValueError(f"cannot read num_heads from {type(layer).__name__}")
    ffn = layer.fc1.out_features if hasattr(layer, "fc1") else layer.mlp.fc1.out_features
    dtype = next(layer.parameters()).dtype
    return LayerShape(hidden, int(heads), ffn / hidden, dtype, bool(getattr(layer, "causal", True)))


def _layers_of(model_or_shape, num_layers):
    if isinstance(model_or_shape, nn.Module):
        from .layers import SelectiveDecoderLayer

        layers = [m for m in model_or_shape.modules() if isinstance(m, SelectiveDecoderLayer)]
        if not layers:
            raise ValueError("model_or_shape holds no SelectiveDecoderLayer")
        if num_layers is not None and num_layers != len(layers):
            raise ValueError(f"num_layers={num_layers} but the model holds {len(layers)} SelectiveDecoderLayers")
        return [_layer_shape(m) for m in layers]
    if isinstance(model_or_shape, LayerShape):
        shape = model_or_shape
    elif isinstance(model_or_shape, dict):
        d = dict(model_or_shape)
        num_layers = d.pop("num_layers", num_layers)
        try:
            shape = LayerShape(**d)
        except TypeError as err:
            raise ValueError(f"model_or_shape dict: {err}; keys are hidden_dim, num_heads, mlp_ratio, dtype, "
                             "causal, num_layers") from None
    else:
        raise TypeError("model_or_shape must be a model holding SelectiveDecoderLayers, a LayerShape or a dict "
                        f"with hidden_dim, num_heads, num_layers (...), got {type(model_or_shape).__name__}")
    if num_layers is None:
        raise ValueError("num_layers is required when model_or_shape is a shape")
    check_positive_int(num_layers, "num_layers")
    shape = dataclasses.replace(shape, dtype=as_dtype(shape.dtype))
    _check_shape(shape.hidden_dim, shape.num_heads, shape.mlp_ratio)
    return [shape] * num_layers


def _layer_figures(shape, batch, seq_len):
    """{mode: (kept bytes, re-run working set, cost)} for one layer."""
    est = functools.partial(estimate, shape.hidden_dim, shape.num_heads, seq_len, batch, shape.dtype, shape.mlp_ratio)
    cost = functools.partial(recompute_flops, shape.hidden_dim, shape.num_heads, seq_len, batch, shape.mlp_ratio,
                             causal=shape.causal)
    rerun = est("selective") - est("full")  # a full layer's re-run keeps its selective set again, once
    return {m: (est(m), rerun if m == "full" else 0, cost(m)) for m in MODES}


def plan(model_or_shape, batch, seq_len, budget_bytes, *, num_layers=None, modes=MODES):
    """Recompute mode per layer fitting `budget_bytes` of activations with the least recompute cost.

    model_or_shape: a model holding SelectiveDecoderLayers (their shapes and dtype are read from
    it), or a LayerShape / dict(hidden_dim, num_heads, mlp_ratio=4, dtype=float32, causal=True,
    num_layers) for a model not built yet.

    Memory model: the activations kept for backward (`estimate` per layer and mode, summed over
    layers), plus, when any layer is "full", the largest such layer's re-run working set: its
    backward re-runs its forward, which keeps the layer's "selective" set again until that layer's
    backward is done (counted once: layers run backward one at a time). Weights, gradients,
    optimizer state and kernel workspaces are not in it: leave room for them in the budget.

    Cost model (`recompute_flops`): none = 0; selective = its elementwise recompute (two LayerNorm
    outputs and the GELU output, ~10 FLOPs per element: well under 1 % of a forward); full = one
    more forward of the layer (matmuls, attention, elementwise). The plan minimises the summed
    cost; ties go to fewer kept bytes. Full layers are placed first, since their re-run happens
    last in backward, when the fewest activations are still kept.

    Returns a Plan (a list of modes, one per layer, plus cost_flops, kept_bytes, peak_bytes and
    max_batch: the largest batch that fits with every layer in one mode, per mode). An infeasible
    budget raises ValueError stating the minimum.
    """
    check_positive_int(batch, "batch")
    check_positive_int(seq_len, "seq_len")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}")
    modes = tuple(modes)
    if not modes:
        raise ValueError("modes must name at least one recompute mode")
    for m in modes:
        check_mode(m)
    shapes = _layers_of(model_or_shape, num_layers)

    # Group identical layers: within a group only the counts per mode matter.
    groups = OrderedDict()
    for i, s in enumerate(shapes):
        groups.setdefault(s, []).append(i)

    # Exact search over per-group mode counts; states (kept, working set) -> (cost, choice per group),
    # with dominated states (more bytes, more working set and more cost) pruned.
    states = {(0, 0): (0, ())}
    for shape, idx in groups.items():
        fig = _layer_figures(shape, batch, seq_len)
        n = len(idx)
        new = {}
        for (kept, work), (cost, choice) in states.items():
            for counts in _compositions(n, len(modes)):
                k = kept + sum(c * fig[m][0] for c, m in zip(counts, modes))
                w = max([work] + [fig[m][1] for c, m in zip(counts, modes) if c])
                cst = cost + sum(c * fig[m][2] for c, m in zip(counts, modes))
                if k + w > budget_bytes:
                    continue
                key = (k, w)
                if key not in new or cst < new[key][0]:
                    new[key] = (cst, choice + (counts,))
        states = _pareto(new)
        if not states:
            break

    max_batch = {m: _max_batch(shapes, seq_len, budget_bytes, m) for m in modes}
    if not states:
        floor = min(_peak(shapes, batch, seq_len, [m] * len(shapes)) for m in modes)
        best = min(modes, key=lambda m: _peak(shapes, batch, seq_len, [m] * len(shapes)))
        raise ValueError(
            f"budget_bytes={int(budget_bytes)} ({format_bytes(budget_bytes)}) cannot hold {len(shapes)} layers at "
            f"batch={batch}, seq_len={seq_len}: the minimum is {floor} bytes ({format_bytes(floor)}), every layer "
            f"{best!r}; largest batch per mode at this budget: {max_batch}")
    (kept, work), (cost, choice) = min(states.items(), key=lambda kv: (kv[1][0], kv[0][0] + kv[0][1]))
    out = [None] * len(shapes)
    order = [m for m in ("full", "selective", "none") if m in modes]
    for idx, counts in zip(groups.values(), choice):
        per_mode = dict(zip(modes, counts))
        seq = [m for m in order for _ in range(per_mode[m])]
        for i, m in zip(idx, seq):
            out[i] = m
    return Plan(out, cost, kept, kept + work, int(budget_bytes), max_batch)


def _compositions(n, k):
    """All k-tuples of non-negative ints summing to n."""
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


def _pareto(states):
    items = sorted(states.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[1][0]))
    kept = {}
    for key, val in items:
        if any(k[0] <= key[0] and k[1] <= key[1] and v[0] <= val[0] for k, v in kept.items()):
            continue
        kept[key] = val
    return kept


def _peak(shapes, batch, seq_len, modes):
    figs = [_layer_figures(s, batch, seq_len) for s in shapes]
    return sum(f[m][0] for f, m in zip(figs, modes)) + max(f[m][1] for f, m in zip(figs, modes))


def _max_batch(shapes, seq_len, budget_bytes, mode):
    """Largest batch with every layer in `mode` under the budget (0 if batch 1 does not fit)."""
    per_sample = _peak(shapes, 1, seq_len, [mode] * len(shapes))  # everything is linear in batch
    return int(budget_bytes // per_sample)
