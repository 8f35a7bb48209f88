"""Dropping norm and activation outputs after forward and rebuilding them once in backward.

Mechanism (docs/DESIGN.md, "Converted models"): saved-tensor hooks keyed on the output's storage.
Inside a `scope()` (one decoder layer's forward), a patched norm or activation calls
`discardable(y, rebuild, *args)`. Whichever module then saves y (or a view of y) for its backward
— a plain Linear, a PEFT LoRA layer, a quantized Linear — gets a small placeholder instead of the
tensor, so nothing keeps y alive once the forward has moved on. The first consumer whose backward
unpacks the placeholder calls `rebuild(*args)` once under no_grad; every other consumer of the same
y (q, k, v projections, LoRA A) shares that result, which dies with the last placeholder.

Why hooks and not freeing storage: nothing is mutated, so a consumer that reads y again in
forward, a hook that inspects it or an in-place op that bumps its version stays correct (a saved
tensor whose version moved since registration is saved as usual), and the rebuild happens exactly
when a consumer first needs it, whatever order backward runs in.

Scopes are not entered under torch.compile (AOTAutograd decides what is saved there) nor inside
another saved-tensor hook context (torch.utils.checkpoint, offloading): the outer mechanism then
decides what is kept, and y is kept as usual.
"""

import contextlib
import threading

import torch

_state = threading.local()


class _Rebuild:
    """A dropped output: how to rebuild it, and the rebuilt value while consumers still need it."""

    __slots__ = ("fn", "args", "value", "count")

    def __init__(self, fn, args):
        self.fn, self.args, self.value, self.count = fn, args, None, 0

    def get(self):
        if self.value is None:
            self.count += 1
            with torch.no_grad():
                self.value = self.fn(*self.args).contiguous()
        return self.value


class _Placeholder:
    """What a consumer's graph node keeps instead of y (or a view of y): the view's geometry."""

    __slots__ = ("rebuild", "size", "stride", "offset")

    def __init__(self, rebuild, size, stride, offset):
        self.rebuild, self.size, self.stride, self.offset = rebuild, size, stride, offset

    def unpack(self):
        return self.rebuild.get().as_strided(self.size, self.stride, self.offset)


class _Scope:
    def __init__(self):
        self.outputs = {}  # storage data_ptr -> (y, version at registration, _Rebuild)

    def pack(self, t):
        entry = self._entry(t)
        if entry is None:
            return t
        y, _, rebuild = entry
        return _Placeholder(rebuild, t.size(), t.stride(), t.storage_offset() - y.storage_offset())

    def _entry(self, t):
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return None
        try:
            entry = self.outputs.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            return None
        if entry is None:
            return None
        y, version, _ = entry
        # y is held by the scope, so its storage cannot have been reused; the version guards in-place edits.
        if t.dtype != y.dtype or t._version != version or t.storage_offset() < y.storage_offset():
            return None
        return entry

    @staticmethod
    def unpack(packed):
        return packed.unpack() if isinstance(packed, _Placeholder) else packed


def _outer_hooks_active():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


@contextlib.contextmanager
def scope(enabled=True):
    """Drops registered outputs from what the forward inside saves (see the module doc).

    A no-op when disabled, when gradients are off, under torch.compile and inside another
    saved-tensor hook context. Scopes do not nest: an inner one takes over until it exits.
    """
    if (not enabled or not torch.is_grad_enabled() or torch.compiler.is_compiling() or _outer_hooks_active()):
        yield None
        return
    current = _Scope()
    previous = getattr(_state, "scope", None)
    _state.scope = current
    try:
        with torch.autograd.graph.saved_tensors_hooks(current.pack, current.unpack):
            yield current
    finally:
        _state.scope = previous
        current.outputs.clear()  # the scope's references to the outputs end with the forward


def discardable(y, rebuild, *args):
    """Registers y as rebuilt by `rebuild(*args)` (bit-identical, under no_grad) if a scope is active.

    `args` should be tensors the producing op keeps for its own backward anyway (its input and
    statistics), so the placeholder costs nothing. Returns y.
    """
    current = getattr(_state, "scope", None)
    if current is not None and isinstance(y, torch.Tensor) and y.is_contiguous() and torch.is_grad_enabled():
        current.outputs[y.untyped_storage().data_ptr()] = (y, y._version, _Rebuild(rebuild, args))
    return y


def active():
    """Whether outputs registered now would be dropped (a scope is active on this thread)."""
    return getattr(_state, "scope", None) is not None
