"""Recomputable layers: one attribute, one listing, and the decoder-layer types the tools know.

A recomputable layer is a module carrying the attribute `STATE` (`"_selective_ckpt"`): an object
with a settable `recompute` mode ("none", "selective", "full") and `shape()`, the layer's
LayerShape fields (memory.planner) with its parameters' dtype. A SelectiveDecoderLayer is its own
state (`recomputable` below); a converted Hugging Face decoder layer holds a
models.converted_layer.ConvertedLayerState. `recomputable_layers(model)` lists them in module order:
set_recompute, the memory planner and the benchmark all walk a model through it.

`register_layer_type(cls)` adds a decoder-layer class to `layer_types()`, the layers the memory
ledger attributes saved tensors to by default. Layer modules register themselves when defined, so
the ledger (memory/) never imports the layers or the model integrations.
"""

STATE = "_selective_ckpt"

_LAYER_TYPES = []


def state_of(module):
    """The recompute state of a recomputable layer (see the module doc), or None for any other module."""
    return getattr(module, STATE, None)


def recomputable_layers(model):
    """The recomputable layers of `model` (itself included), in module order."""
    return [m for m in model.modules() if state_of(m) is not None]


def register_layer_type(cls):
    """Adds `cls` to layer_types() (once); returns cls, so it serves as a class decorator."""
    if cls not in _LAYER_TYPES:
        _LAYER_TYPES.append(cls)
    return cls


def layer_types():
    """The registered decoder-layer classes, in registration order."""
    return tuple(_LAYER_TYPES)


def recomputable(cls):
    """Class decorator: instances of `cls` (which define `recompute` and `shape()`) are their own
    recompute state, and cls is a registered layer type."""
    setattr(cls, STATE, property(lambda self: self, doc="This layer: its own recompute state (registry.STATE)."))
    return register_layer_type(cls)
