"""PEFT adapters inside converted decoder layers: LoRA dropout by seed, refusals, modules not known.

PEFT's LoRA computes `lora_B(lora_A(dropout(x)))`; the dropout output is a new tensor that lora_A
saves for its weight gradient (a full copy of the input per adapted projection). Its nn.Dropout
modules get the seeded dropout of models/patches.py (the elementwise stream of the dropout
contract): the dropped input is rebuilt in backward from the rebuilt input and an 8-byte seed.
PEFT's own forward is left alone, so `set_adapter`, `disable_adapter()`, several adapters,
`use_rslora`, merging and `merge_and_unload` keep PEFT's semantics; eval mode applies no dropout.

Under autocast, autocast's cast of a frozen base weight has no autograd node, so the layer pipeline could
only find it by watching every op (a Python call per op); the LoRA layers' Linears (base layer, lora_A,
lora_B) get `adapter_linear_forward`, which makes those casts itself, as autocast would, and shows them to
the pipeline (keeping.pipeline.cast).

Adapters may be added, removed or swapped before or after convert: each converted layer checks its
adapters when its modules change (models/converted_layer.py, `ConvertedLayerState.make_current`).
bitsandbytes' 8-bit Linear trains on CPU through MatMul8bitFp, which holds its input as a plain
attribute of the autograd context (outside save_for_backward, so no saved-tensor hook sees it) and
reads it only for the weight gradient; for a frozen int8 weight that reference is dropped after
forward (`int8_linear_forward`).

DoRA (`use_dora=True`) rebuilds the adapted weight's norm from the base weight, which
selective_ckpt does not rebuild: it is refused by name.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .. import compat
from ..keeping import pipeline
from .errors import ConversionError
from .patches import dropout_forward

# Module classes a converted layer may hold whose saved tensors the layer pipeline handles: the
# families' own blocks are checked by their plans; these are the consumers found inside them.
KNOWN_CONSUMERS = ("Linear", compat.CONV1D, *compat.QUANTIZED_LINEARS, "Dropout", "Identity", "ModuleDict",
                   "ParameterDict", *compat.PEFT_CONTAINERS)
KNOWN_PARAMETERS = ("Parameter", *compat.QUANTIZED_PARAMETERS)


def int8_linear_forward(self, x):
    """bitsandbytes Linear8bitLt's own forward, then, when its autograd node is MatMul8bitFp's (CPU/XPU
    training) and its weight takes no gradient, the node's reference to the input is dropped: that
    backward reads the input only for the weight gradient, and holding it keeps a rebuilt norm or
    activation output alive (the norm output per projection input, the MLP product for down_proj)."""
    out = type(self).forward(self, x)
    node = compat.int8_input_holder(out)
    if node is not None and not node.needs_input_grad[1]:
        compat.drop_int8_input(node)
    return out


_AUTOCAST_DEVICES = ("cpu", "cuda")


def adapter_linear_forward(self, x):
    """nn.Linear's forward for the Linears of a LoRA layer (its base layer, lora_A, lora_B). Under autocast inside
    a layer pipeline, the arguments autocast would cast without a graph node (those that take no gradient: the
    frozen base weight, an input without gradients) are cast here first, exactly as autocast casts them
    (`to(autocast dtype)`, floating tensors but float64 on the autocast device), and shown to the pipeline
    (keeping.pipeline.cast), which then rebuilds them without watching every op; autocast finds them cast.
    Arguments that take gradients are left to autocast (its cached cast of a weight has a graph node)."""
    weight, bias = self.weight, self.bias
    device = x.device.type
    if device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device) and pipeline.active():
        dtype = torch.get_autocast_dtype(device)
        x, weight = _autocast_cast(x, dtype, device), _autocast_cast(weight, dtype, device)
        if bias is not None:
            bias = _autocast_cast(bias, dtype, device)
    return F.linear(x, weight, bias)


def _autocast_cast(t, dtype, device):
    if t.requires_grad or not t.is_floating_point() or t.dtype in (dtype, torch.float64) \
            or t.device.type != device:
        return t
    return pipeline.cast(t, dtype)


def _adapter_linears(lora):
    """The plain nn.Linear modules of a LoRA layer: its base layer and its adapters' A and B."""
    found = [getattr(lora, "base_layer", None)]
    for attr in ("lora_A", "lora_B"):
        found += list(getattr(lora, attr, {}).values())
    return [m for m in found if type(m) is nn.Linear]


def _lora_layers(module):
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft missing: no adapter can be in the model
        return []
    return [(n, m) for n, m in module.named_modules() if isinstance(m, LoraLayer)]


def _check_variants(name, lora):
    variants = getattr(lora, "lora_variant", {}) or {}
    dora = [a for a, on in (getattr(lora, "use_dora", {}) or {}).items() if on]
    if dora or variants:
        kinds = sorted({type(v).__name__ for v in variants.values()} | ({"DoRA"} if dora else set()))
        raise ConversionError(f"{name} ({type(lora).__name__}): LoRA variant {', '.join(kinds)} (e.g. use_dora=True) "
                              "is not supported: its weight-norm path is not rebuilt in backward; use plain LoRA")


def plan_adapters(root, owner=""):
    """(module, forward) patches for the LoRA dropouts, LoRA layers' Linears and 8-bit Linears under `root`;
    raises ConversionError for LoRA variants."""
    patches = [(m, int8_linear_forward) for m in root.modules() if compat.is_int8_linear(m)]
    for name, lora in _lora_layers(root):
        full = f"{owner}.{name}" if owner and name else (name or owner)
        _check_variants(full, lora)
        for drop in getattr(lora, "lora_dropout", {}).values():
            if type(drop) is nn.Dropout:
                if drop.inplace:
                    raise ConversionError(f"{full}: in-place LoRA dropout cannot be converted")
                patches.append((drop, dropout_forward))
        patches += [(m, adapter_linear_forward) for m in _adapter_linears(lora)]
    return patches


def unknown_modules(layer):
    """Names of modules inside a converted layer whose class selective_ckpt does not know (their saved
    tensors are kept as they are: a quantized Linear of another library, an adapter other than LoRA)."""
    known = set(KNOWN_CONSUMERS)
    out = []
    for name, m in layer.named_modules():
        cls = type(m)
        if not name or cls.__name__ in known or cls.__module__.startswith(("transformers.", "torch.nn.")):
            continue
        if compat.is_peft_lora_linear(cls):
            continue
        out.append(f"{name} ({cls.__module__}.{cls.__name__})")
    for name, p in layer.named_parameters():
        if type(p).__name__ not in KNOWN_PARAMETERS:
            out.append(f"{name} (a {type(p).__module__}.{type(p).__name__} weight)")
    return out
