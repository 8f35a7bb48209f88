"""The parts of a converted decoder layer, one per role of a model spec's children, with one small protocol:

- `cls`: the class (or class name) of the modules the part converts;
- `check(module, name, model_type)`: ConversionError, before anything changes, when `module` cannot convert;
- `forward(module)`: the patched forward of a module of this part, or None where it stays transformers' own;
- `shape(module, config)`: the LayerShape fields of what it keeps (memory.estimate), from the spec and `module`:
  its widths and `parts`, the memory part (memory/parts.py) of what the module keeps.

The driver (models/hf.py) checks each child of a layer by its part and patches every module of each part's class;
the shape reader (models/layer_shape.py) merges the parts' fields, each memory part in its role's place. A new kind
of child is a new part.
"""

import functools

from torch import nn

from ..activations import kernel_activation
from ..memory.estimate import Mixer
from ..memory.parts import Attention, DenseMLP, Scalars
from . import attention
from .checks import check_activation, check_children, check_norm, check_present, is_class
from .errors import ConversionError
from .kept_mixer import mixer_saved_bytes
from .patches import (
    dropout_forward,
    fc_mlp_forward_factory,
    gate_up_mlp_forward,
    layer_norm_forward,
    own_forward_norm,
    packed_gate_up_mlp_forward,
    rms_norm_forward,
)


def norm_forward(norm, kept="residual"):
    """The patched forward of a norm of NormSpec `norm` whose input is of class `kept` (keeping.policy) when nothing
    named it."""
    if norm.rounding == "float32_scale":
        forward = own_forward_norm
    elif norm.kind == "layernorm":
        forward = layer_norm_forward
    elif norm.offset == 0:
        forward = rms_norm_forward
    else:
        forward = functools.partial(rms_norm_forward, offset=float(norm.offset))
    return forward if kept == "residual" else functools.partial(forward, kept=kept)


class NormPart:
    """A norm of the spec's NormSpec: the fused kernel's forward (or the norm's own, for float32-scale rounding),
    keeping its input and, where it can, its statistics."""

    def __init__(self, spec):
        self.norm = spec.norm
        self.cls = spec.norm.cls

    def check(self, module, name, model_type):
        check_norm(module, name, self.norm.kind)

    def forward(self, module, kept="residual"):
        return norm_forward(self.norm, kept)

    def shape(self, module, config):
        return {"norm": self.norm.kind} if self.norm.keeps_stats else {"norm": self.norm.kind, "norm_stats": False}


class AttentionPart:
    """The attention: its children (and q/k norms) checked, its head width and window read; patched by the driver
    only where its q/k norms come before RoPE (attention.qk_normed_forward), else transformers' own forward runs
    our kernels through the attention registry."""

    def __init__(self, spec):
        self.spec = spec
        self.cls = spec.attention
        self.required = [c for c in spec.attention_all if c not in spec.attention_optional]

    def check(self, module, name, model_type):
        check_children(module, name, self.spec.attention_all, model_type)
        check_present(module, name, self.required, model_type)

    def q_norm(self, module):
        """The q norm `module` holds (None: none, the spec's qk_norm off or its norms optional by config)."""
        return getattr(module, self.spec.qk_norm_children[0], None) if self.spec.qk_norm else None

    def forward(self, module):
        if self.spec.qk_norm in (True, "projection") and self.q_norm(module) is not None:
            return attention.qk_normed_forward  # norms before RoPE: RoPE's outputs rebuilt too
        return None

    def shape(self, module, config):
        """Head width (given only where heads x head_dim is not hidden_size), window, and memory's Attention with its
        q/k norms and output gate; with v normed too (a third norm) each projection's output is kept once, as its
        norm's input: no q/k form."""
        spec, h, heads = self.spec, config.hidden_size, config.num_attention_heads
        head_dim = getattr(module, "head_dim", h // heads)
        fields = {"sliding_window": getattr(module, "sliding_window", None) or None}
        if head_dim * heads != h:
            fields["head_dim"] = head_dim
        qk_norm = spec.qk_norm if self.q_norm(module) is not None and len(spec.qk_norm_children) < 3 else None
        return {**fields, "parts": (Attention(qk_norm, bool(spec.attention_gate)),)}


class MLPPart:
    """The dense MLP of the spec's MLPSpec: its layout's forward (or the spec's own), keeping gate and up (or
    fc_in's output)."""

    def __init__(self, spec):
        self.mlp = spec.mlp
        self.cls = spec.mlp.cls

    def check(self, module, name, model_type):
        check_children(module, name, self.mlp.children, model_type)
        check_activation(module, name, model_type, self.mlp.activation)

    def forward(self, module):
        mlp = self.mlp
        if mlp.forward is not None:
            return mlp.forward
        if mlp.layout == "gate_up":
            return gate_up_mlp_forward
        if mlp.layout == "packed_gate_up":
            return packed_gate_up_mlp_forward
        fc_in, act, fc_out, *dropout = mlp.children
        return fc_mlp_forward_factory(fc_in, act, fc_out, dropout[0] if dropout else None)

    def shape(self, module, config):
        """The activation memory.estimate counts: a gated MLP keeps gate and up whatever its activation ("swiglu"
        for SiLU, "geglu" for any other); a plain one its fc_in output ("gelu_tanh" for tanh-GELU, else "gelu")."""
        kernel = kernel_activation(getattr(module, self.mlp.activation))
        if self.mlp.gated:
            return {"activation": "swiglu" if kernel == "silu" else "geglu", "parts": (DenseMLP(gated=True),)}
        return {"activation": "gelu_tanh" if kernel == "gelu_tanh" else "gelu", "parts": (DenseMLP(gated=False),)}


class MoEPart:
    """A sparse mixture-of-experts block of the spec's MoESpec (models/moe.py), which the MLP child may be: checked
    and patched by its MoESpec (block and experts forwards), counted as memory.MoE."""

    def __init__(self, spec):
        self.spec = spec
        self.moe = spec.moe
        self.cls = spec.moe.block

    def check(self, module, name, model_type):
        self.moe.check_block(module, name, model_type, self.spec.mlp.cls)

    def forward(self, module):
        return None  # MoESpec.patches patches the block and its experts

    def shape(self, module, config):
        moe = self.moe.memory(module)
        scalars = (Scalars(self.moe.scalars),) if self.moe.scalars else ()
        return {"ffn_dim": moe.expert_dim, "mlp_ratio": moe.expert_dim / config.hidden_size, "parts": (moe, *scalars),
                "activation": self.moe.activation(module)}


class MixerPart:
    """A token mixer kept as transformers' own (the spec's MixerSpec): not patched, counted by its own forward
    run on fake tensors (memory.Mixer)."""

    def __init__(self, spec):
        self.mixer = spec.mixer
        self.cls = spec.mixer.cls

    def check(self, module, name, model_type):
        pass

    def forward(self, module):
        return None

    def shape(self, module, config):
        saved = functools.partial(mixer_saved_bytes, module)
        return {"parts": (Mixer(type(module).__name__, saved, attention=self.mixer.beside_attention),)}


class DropoutPart:
    """A layer's own nn.Dropout: by seed (8 bytes) instead of a mask; counted with the layer's training rates."""

    cls = nn.Dropout

    def __init__(self, spec):
        self.spec = spec

    def check(self, module, name, model_type):
        if not self.spec.dropout:
            raise ValueError(f"model spec {self.spec.model_types}: a dropout child needs dropout=True")
        if module.inplace:
            raise ConversionError(f"{name}: in-place nn.Dropout cannot be converted")

    def forward(self, module):
        return dropout_forward

    def shape(self, module, config):
        return {}


def part_of(spec, role, module):
    """The part converting `module`, a layer's child of `role` under `spec` (None for role "own": the spec's check
    verifies those); the MLP child may be the spec's MoE block instead."""
    if role == "mlp" and spec.moe is not None and is_class(module, spec.moe.block):
        return MoEPart(spec)
    return {"norm": NormPart, "attention": AttentionPart, "mlp": MLPPart, "mixer": MixerPart,
            "dropout": DropoutPart}.get(role, lambda spec: None)(spec)
