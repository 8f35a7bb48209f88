"""Converted models keep their patched forwards through transformers' hub-kernel kernelization.

With the `kernels` package installed, transformers (5.2x) kernelizes every model that `from_pretrained`
loads, and kernelizes it again whenever its training mode changes (`model.train()`, which Trainer calls
every step, and `model.eval()`): `kernels.kernelize` sets or drops the instance forward of each module
whose class carries a hub-kernel name (RMSNorm among them). That dropped the norms' patched forwards
of a converted model at its first `train()`, silently: its norms kept their outputs again. Here each
PreTrainedModel of a converted model runs its kernelization and then puts the patched forwards back
(converted_layer.make_patches_current); a layer checks its own at every training call, for a `kernelize`
called directly (converted_layer.ConvertedLayerState.make_current).
"""

from .converted_layer import make_patches_current
from .patching import BoundForward

_WRAPPED = ("set_use_kernels", "reset_kernels")


def set_use_kernels(self, use_kernels, *args, **kwargs):
    """transformers' set_use_kernels, then the patched forwards it replaced are put back."""
    try:
        return type(self).set_use_kernels(self, use_kernels, *args, **kwargs)
    finally:
        make_patches_current(self)


def reset_kernels(self):
    """transformers' reset_kernels, then the patched forwards it replaced are put back."""
    try:
        return type(self).reset_kernels(self)
    finally:
        make_patches_current(self)


def keep_patches(root):
    """Makes every transformers PreTrainedModel under `root` that can kernelize itself restore the patched
    forwards after it does (instance attributes, which pickle with the model)."""
    from transformers import PreTrainedModel

    for module in root.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        for name, function in ((n, globals()[n]) for n in _WRAPPED):
            if callable(getattr(type(module), name, None)):
                module.__dict__[name] = BoundForward(function, module)
