"""The ledger: what one forward keeps for backward, by distinct storage, per layer, module and op.

`ledger(fn_or_module, *inputs)` runs one forward under saved-tensor hooks and counts the bytes
kept for backward by distinct storage (views of one buffer count once), parameters and buffers
excluded. Each saved tensor is attributed to the innermost module running when it was saved, to
the op that allocated its storage and to its grad_fn. Tensors cached by PyTorch's selective
checkpointing do not pass through saved-tensor hooks; `sac_context_fn` builds a policy that
reports them.
"""

import contextlib
import dataclasses
from collections import OrderedDict

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..keeping import pipeline
from ..registry import state_of
from ..storages import storage_id
from .estimate import KEPT_MIXER
from .units import columns, format_bytes


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
    kind: str = "other"  # its class (keeping.policy.CLASSES), as the layer's pipeline named it
    residence: str = "device"  # "host" when the layer's offload engine copies it out after the layer
    # the token mixer kept as transformers' own (estimate.KEPT_MIXER) whose forward saved it, or None
    mixer: str = None


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
    def mixer_bytes(self):
        """Bytes saved inside token mixers kept as transformers' own (a hybrid model's Gated DeltaNet), per layer:
        what their own implementation keeps, counted apart from the floor the converted rest keeps. Counted as it
        is saved, also what a branch the layer's output does not reach saved (memory.estimate counts only what
        the graph still holds after the forward)."""
        out = OrderedDict()
        for e in self.entries:
            if e.mixer is not None:
                out[e.layer] = out.get(e.layer, 0) + e.bytes
        return out

    @property
    def by_module(self):
        return self._group("module")

    @property
    def by_op(self):
        return self._group("op")

    @property
    def device_bytes(self):
        """Bytes kept on the device."""
        return sum(e.bytes for e in self.entries if e.residence == "device")

    @property
    def host_bytes(self):
        """Bytes an offload engine holds in host memory."""
        return sum(e.bytes for e in self.entries if e.residence == "host")

    def by_class(self, layer=None):
        """{class: {"device": bytes, "host": bytes}} over every entry, or over one layer's (a by_layer key)."""
        out = OrderedDict()
        for e in self.entries:
            if layer is None or e.layer == layer:
                out.setdefault(e.kind, {"device": 0, "host": 0})[e.residence] += e.bytes
        return out

    def table(self) -> str:
        head = ("layer", "module", "op", "grad_fn", "class", "where", "shape", "dtype", "views", "bytes")
        rows = [(e.layer, e.module, e.op, e.grad_fn, e.kind, e.residence, "x".join(map(str, e.shape)) or "scalar",
                 str(e.dtype).replace("torch.", ""), str(e.views), str(e.bytes)) for e in self.entries]
        pad = ("",) * (len(head) - 2)
        rows.append(("total", *pad, f"{self.total} ({format_bytes(self.total)})"))
        if self.host_bytes:
            rows.append(("on the device", *pad, f"{self.device_bytes} ({format_bytes(self.device_bytes)})"))
            rows.append(("in host memory", *pad, f"{self.host_bytes} ({format_bytes(self.host_bytes)})"))
        layers = self.by_layer
        if len(layers) > 1 or "-" not in layers:
            rows += [("",) * len(head)]
            rows += [(f"layer {k}", *pad, f"{v} ({format_bytes(v)})") for k, v in layers.items()]
        return "\n".join(columns(head, rows, right={len(head) - 1}))

    __str__ = table

    def __repr__(self):
        return f"LedgerReport(total={self.total}, entries={len(self.entries)}, by_layer={dict(self.by_layer)})"


_ACTIVE = []  # the ledgers recording now (innermost last); note_saved reports to the innermost


def _default_layer_types():
    # The decoder-layer classes registered with selective_ckpt.registry (they register when defined).
    from ..registry import layer_types

    return layer_types()


def storage_key(t):
    """(key, bytes) of t's storage: views of one storage share a key (storages.storage_id); a tensor without a
    storage is its own key."""
    sid = storage_id(t)
    if sid is None:  # no plain storage (subclass, sparse)
        return ("id", id(t)), t.numel() * t.element_size()
    return ("storage", sid), t.untyped_storage().nbytes()


class _Producers(torch.utils._python_dispatch.TorchDispatchMode):
    """Remembers which op allocated each storage during the ledger's forward (saved LayerNorm
    statistics and custom-op outputs have no grad_fn to name them)."""

    def __init__(self):
        super().__init__()
        self.by_key = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(a)[0] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = storage_key(t)[0]
                if key not in inputs:
                    self.by_key[key] = _op_name(func)
        return out


def _op_name(func):
    name = getattr(func, "_schema", None)
    name = name.name if name is not None else getattr(func, "__name__", str(func))
    return name.replace("::", ".")


def is_ledger_hook(hook):
    """Whether `hook`, a global module hook, is a ledger's own (it names the module running; a layer whose forward
    bypasses its submodules is still named by its own call)."""
    return isinstance(getattr(hook, "__self__", None), _Recorder)


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
        self.offloaded = []  # (entry, the offload engine's handle): where each one ends is read after the forward
        for obj in exclude:
            if isinstance(obj, nn.Module):
                self._exclude_module(obj)
            elif isinstance(obj, torch.Tensor):
                self.excluded.add(storage_key(obj)[0])
            else:
                raise TypeError(f"exclude must hold modules or tensors, got {type(obj).__name__}")
        for m in (root, names_from):
            if isinstance(m, nn.Module):
                self._exclude_module(m)

    def _exclude_module(self, module):
        for t in list(module.parameters()) + list(module.buffers()):
            self.excluded.add(storage_key(t)[0])

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

    def is_layer(self, module):
        return isinstance(module, self.layer_types) or state_of(module) is not None

    def where(self):
        module = self.name(self.stack[-1]) if self.stack else "-"
        layer = next((self.name(m) for m in reversed(self.stack) if self.is_layer(m)), "-")
        return module, layer

    def mixer(self):
        return next((self.name(m) for m in reversed(self.stack) if getattr(m, KEPT_MIXER, None)), None)

    def add(self, t, op=None, kind="other", handle=None):
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
            return
        key, nbytes = storage_key(t)
        if key in self.excluded:
            return
        if key in self.entries:
            entry = self.entries[key]
            entry.views += 1
            if entry.kind == "other":
                entry.kind = kind
            if handle is not None:
                self.offloaded.append((entry, handle))
            return
        if nbytes == 0:
            return
        fn = t.grad_fn
        grad_fn = type(fn).__name__ if fn is not None else "-"
        if op is None:
            op = self.producers.by_key.get(key) if self.producers is not None else None
            op = op or (grad_fn if fn is not None else "input")
        module, layer = self.where()
        self.entries[key] = SavedEntry(tuple(t.shape), t.dtype, nbytes, module, layer, op, grad_fn, kind=kind,
                                       mixer=self.mixer())
        if handle is not None:
            self.offloaded.append((self.entries[key], handle))
        self.keep_alive.append(t)

    def note(self, t, kind, handle):
        """What a layer's pipeline keeps (keeping.pipeline.observe): t of class `kind`, offloaded when `handle`."""
        self.add(t, kind=kind, handle=handle)

    def settle(self):
        """Residences after the forward: an offloaded storage is in host memory once its engine copied it out
        (every layer's but the last, whose backward runs first)."""
        for entry, handle in self.offloaded:
            if handle.offloaded:
                entry.residence = "host"

    def pack(self, t):
        self.add(t)
        # A detached alias: returning t itself would make an output and its grad_fn a reference
        # cycle that outlives the ledger until the garbage collector runs. The ledger never runs
        # backward, so the unpacked value only needs the same storage.
        return t.detach()


def ledger(fn_or_module, *inputs, model=None, layer_types=None, exclude=(), track_ops=True, **kwargs) -> LedgerReport:
    """Run `fn_or_module(*inputs, **kwargs)` once with grad enabled and report what it keeps for backward.

    Counting is by distinct storage (`storages.storage_id`), so q, k and v saved as views
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
    bypass the hooks: use `sac_context_fn`, which reports them here. So do 0-dim Python-number
    operands autograd keeps (8 bytes each, e.g. PEFT LoRA's `* scaling`): they are not counted.
    Layer pipelines inside (keeping.pipeline) run as they do without the ledger: it counts what
    they keep, not what they drop, with each tensor's class (`SavedEntry.kind`) and where it ends
    (`residence`: "host" for what an offload engine copies out); `by_class()` sums them. The forward's outputs are
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
            # layer pipelines inside run as they do without the ledger and show it what they keep
            stack.enter_context(pipeline.observe(rec))
            out = fn_or_module(*inputs, **kwargs)
            for mode in rec.sac_modes:  # what selective checkpointing cached and the policy did not report
                for leaf in tree_flatten(list(_sac_cache(mode)))[0]:
                    rec.add(getattr(leaf, "val", leaf), op="sac:cached")
            del out
    finally:
        _ACTIVE.remove(rec)
        for h in handles:
            h.remove()
    rec.settle()
    report = LedgerReport(rec.entries.values())
    rec.keep_alive.clear()
    rec.offloaded.clear()
    return report


def _node_saved(node):
    """Tensors an autograd node holds for backward: saved_tensors (custom and compiled functions)
    and the _saved_* attributes of built-in nodes."""
    found = []
    try:
        found += [t for t in node.saved_tensors if isinstance(t, torch.Tensor)]
    except (AttributeError, RuntimeError):
        pass
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed already
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            found += [t for t in values if isinstance(t, torch.Tensor)]
    return found


def graph_saved_bytes(outputs, exclude=()):
    """Bytes the autograd graph behind `outputs` holds for backward, by distinct storage.

    For code the ledger's hooks would change: saved-tensor hooks make torch.compile fall back from
    its compiled graph (whose partitioner decides what is saved), so a compiled module is measured
    by walking the graph its plain forward built. Parameters, buffers and tensors in `exclude`
    (modules or tensors) are not counted.
    """
    skip = set()
    for obj in exclude:
        tensors = list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, nn.Module) else [obj]
        skip |= {storage_key(t)[0] for t in tensors}
    sizes = {}
    for t in graph_saved_tensors(outputs):
        key, nbytes = storage_key(t)
        if key not in skip and not isinstance(t, nn.Parameter):
            sizes[key] = nbytes
    return sum(sizes.values())


def graph_saved_tensors(outputs):
    """Every tensor a node of the autograd graph behind `outputs` (tensors, or nested containers of them) holds
    for backward, each node visited once."""
    seen = set()
    stack = [t.grad_fn for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield from _node_saved(node)
        stack += [nxt for nxt, _ in node.next_functions]


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
