"""The patch mechanism: how a module's forward is replaced in place, kept, and put back.

A patched module keeps its class, parameters and name; only the instance's `forward` changes. The
original forward is kept under PATCHED and the patched one under PATCH, so that a forward something
else replaced since (transformers' hub-kernel kernelization) can be put back (`restore_patches`).
The patched forward is a `BoundForward`: a bound method that pickles (models/pickling.py), so a
converted model survives torch.save / torch.load and copy.deepcopy.
"""

import copy
import inspect
import types

from .pickling import function_reference

PATCHED = "_selective_ckpt_forward"  # attribute marking a patched module (holds the original forward)
PATCH = "_selective_ckpt_patch"  # the patched forward itself, so that it can be put back (restore_patches)


class BoundForward:
    """`function` bound to `module` as its forward; behaves as the bound method and pickles.

    As a bound method (types.MethodType) it would pickle as `getattr(module, function name)`, which the
    module's class does not have; this pickles as (function, module)."""

    __slots__ = ("function", "module")

    def __init__(self, function, module):
        self.function, self.module = function, module

    def __call__(self, *args, **kwargs):
        return self.function(self.module, *args, **kwargs)

    @property
    def __func__(self):
        return self.function

    @property
    def __self__(self):
        return self.module

    @property
    def __name__(self):
        return self.function.__name__

    @property
    def __signature__(self):
        # A pass-through patch (self, *args, **kwargs) takes what the original forward takes: tools that
        # read the signature (Trainer keeps only the dataset columns forward names) see the original's.
        sig = inspect.signature(types.MethodType(self.function, self.module))
        kinds = [p.kind for p in sig.parameters.values()]
        original = getattr(self.module, PATCHED, None)
        if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD] and original is not None:
            return inspect.signature(original)
        return sig

    def __repr__(self):
        return f"<patched forward {self.function.__qualname__} of {type(self.module).__name__}>"

    def __deepcopy__(self, memo):
        return BoundForward(self.function, copy.deepcopy(self.module, memo))

    def __reduce__(self):
        return BoundForward, (function_reference(self.function), self.module)


def patch_forward(module, forward):
    """Replaces module.forward by `forward` bound to module (a BoundForward, which pickles); the original is
    kept under PATCHED."""
    if getattr(module, PATCHED, None) is None:
        setattr(module, PATCHED, module.forward)
    module.forward = BoundForward(forward, module)
    module.__dict__[PATCH] = module.forward


def replaced(module):
    """Whether `module` was patched and its forward replaced or dropped since (by something other than
    patch_forward)."""
    patch = module.__dict__.get(PATCH)
    return patch is not None and module.__dict__.get("forward") is not patch


def restore_patches(root):
    """Puts back the patched forward of every module under `root` whose forward was replaced since it was
    patched (transformers' hub-kernel kernelization replaces or drops instance forwards); returns their names."""
    restored = []
    for name, module in root.named_modules():
        if replaced(module):
            module.forward = module.__dict__[PATCH]
            restored.append(name or type(module).__name__)
    return restored
