"""Model specs: what a Hugging Face model family's decoder layer is, stated once, and the template of the
Llama-shaped ones.

A model spec (`ModelSpec`, one per model family in models/<family>.py as `SPEC`) names the decoder layer's
class, its children and the role of each (norm, attention, MLP, ...), the norm kind and offset, the MLP layout
and its activation child, the residual form, whether attention holds q/k norms (and which of its children a
layer's attention may lack), and, where a family has one, its own shape reader. The driver (models/hf.py)
checks a model against its spec and converts it; nothing here touches a model.
"""

import dataclasses

from ..validation import NORMS

# "dropout": an nn.Dropout child of the layer (Phi-3's residual ones); "mixer": a token mixer kept as transformers'
# own module (ModelSpec.mixer), which a layer holds instead of its attention
# "own": a child left as transformers' own module (or patched by the spec's patches), which the spec's check verifies
# (Gemma 4's router and experts)
ROLES = ("norm", "attention", "mlp", "dropout", "mixer", "own")
# separate gate_proj / up_proj / down_proj; fc_in -> act -> fc_out (GELU fc); one gate_up_proj whose output
# is chunked into gate and up (Phi-3)
MLP_LAYOUTS = ("gate_up", "fc", "packed_gate_up")
GATE_UP_CHILDREN = ("gate_proj", "up_proj", "down_proj", "act_fn")  # what patches.gate_up_mlp_forward reads
GATE_UP_ACTIVATION_FN_CHILDREN = GATE_UP_CHILDREN[:3] + ("activation_fn",)  # the same, as Llama 4 names them
PACKED_GATE_UP_CHILDREN = ("gate_up_proj", "down_proj", "activation_fn")  # patches.packed_gate_up_mlp_forward
# Residual forms the driver converts. Patching leaves the layer's own forward in place, so any form
# would compute right; the memory estimate (memory/estimate.py) counts what each keeps:
# "pre-norm": x + attn(norm(x)), then x1 + mlp(norm(x1));
# "parallel": attention and MLP both read the layer input (x + attn(norm(x)) + mlp(norm'(x)), one norm shared or
# one each; a family whose layers choose by config says so in its shape reader);
# "post-norm" (OLMo2): x + norm(attn(x)), then x1 + norm(mlp(x1)): the norms' inputs are the o_proj and
# down_proj outputs, and x, x1 are what the projections read;
# "sandwich" (Gemma2/3): x1 = x + post_norm(attn(pre_norm(x))), y = x1 + post_norm(mlp(pre_norm(x1))), four
# norms, whose post-norms keep o_proj's and down_proj's outputs.
RESIDUALS = ("pre-norm", "parallel", "post-norm", "sandwich")
# q/k norms (ModelSpec.qk_norm): per head over head_dim (Qwen3), or over the whole q_proj / k_proj output (OLMo2),
# both before RoPE (whose outputs attention reads, rebuilt: attention.qk_normed_forward), or per head on q and k
# after RoPE ("rotated", HunYuan: attention reads the norms' outputs, rebuilt)
QK_NORMS = (False, True, "projection", "rotated")
NORM_ROUNDINGS = ("llama", "float32_scale")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    kind: str  # "rmsnorm" (y = x * rstd * (offset + w)) or "layernorm" (affine, with or without bias)
    cls: object  # the norm's class name, or the class itself (matched exactly: nn.LayerNorm, not subclasses)
    offset: float = 0.0
    # "llama": w * T(x * rstd) (or Gemma's T(x * rstd * (offset + w))) by the fused kernel; "float32_scale":
    # T(w * (x * rstd)) scaled in float32 and rounded once (OLMo2), computed by the norm's own forward,
    # which keeps only x and runs again in backward (patches.own_forward_norm), so it keeps no statistics
    rounding: str = "llama"

    @property
    def keeps_stats(self):
        """Whether the converted norm keeps its statistics (rstd, and the mean of a LayerNorm) for backward."""
        return self.rounding == "llama"


# where each layout's children name the activation
_LAYOUT_ACTIVATION = {"gate_up": 3, "packed_gate_up": 2, "fc": 1}


@dataclasses.dataclass(frozen=True)
class MLPSpec:
    cls: str  # class name
    layout: str  # one of MLP_LAYOUTS
    children: tuple  # gate_up: GATE_UP_CHILDREN (or ..._ACTIVATION_FN_); fc: (fc_in, activation, fc_out[, dropout])
    forward: object = None  # the MLP's patched forward (self, x); None: the layout's own
    activation: str = None  # the activation child; None: the layout's (act_fn, activation_fn, an fc MLP's second)

    def __post_init__(self):
        index = _LAYOUT_ACTIVATION.get(self.layout)
        if self.activation is None and index is not None and index < len(self.children):
            object.__setattr__(self, "activation", self.children[index])

    @property
    def gated(self):
        """Whether the MLP multiplies its activation by an up projection (the "gate_up" layouts)."""
        return self.layout in ("gate_up", "packed_gate_up")


@dataclasses.dataclass(frozen=True)
class MixerSpec:
    """A token mixer a hybrid model's layers hold instead of attention (a Gated DeltaNet), kept as transformers'
    implementation: its forward runs as it is and keeps what it saves (no kernel of ours reproduces it); the
    layer's norms, MLP and dropouts still convert. Said once at convert (which layers, which module, `why`);
    memory.estimate counts what it saves (memory.Mixer, measured by running its forward on fake tensors)."""

    cls: str  # the mixer's class name
    why: str  # why it is kept as it is, for the line said at convert
    beside_attention: bool = False  # every layer holds it and its attention, both run (Falcon-H1), not one of them


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_types: tuple  # config.model_type values
    layer: str  # decoder layer class name
    children: tuple  # ((child name, role), ...): exactly the layer's children, roles from ROLES
    norm: NormSpec
    attention: str  # attention class name
    attention_children: tuple
    mlp: MLPSpec
    # shape reader (layer, config, spec) -> LayerShape fields (memory.planner); None: layer_shape.config_shape, which
    # reads the form from this spec and the widths from the config (a family's own adds what its config decides)
    shape: object = None
    residual: str = "pre-norm"
    qk_norm: object = False  # attention holds q_norm and k_norm (of the spec's norm class): True per head,
    # "projection" over the whole q_proj / k_proj output, "rotated" per head after RoPE
    # the attention's q and k norm children, when qk_norm; a third one normalises v (Gemma 4), its norms keeping no
    # statistics: then each projection's output is kept once, as its norm's input, and the rest is rebuilt
    qk_norm_children: tuple = ("q_norm", "k_norm")
    # attention's output gated by sigmoid of a second half of q_proj (Qwen3-Next: hybrid.gated_attention_forward)
    attention_gate: bool = False
    # attention children (of attention_children and qk_norm_children) a layer's attention may lack (GLM-4.5's q/k
    # norms by config.use_qk_norm); every other one must be there
    attention_optional: tuple = ()
    dropout: bool = False  # every nn.Dropout of the model keeps a seed instead of a mask
    # products by a Python float in the layer's own forward (Granite's residual multipliers), each keeping the float
    # as a 0-dim float64 tensor
    scalar_multipliers: int = 0
    check: object = None  # extra checks (root, name) raising ConversionError, or None
    patches: object = None  # extra patches (root) -> [(module, forward), ...] after the checks, or None
    moe: object = None  # a sparse mixture-of-experts MLP the "mlp" child may be instead (models/moe.py MoESpec)
    # a composite model's text decoder (e.g. Mistral3ForConditionalGeneration's "model.language_model", whose config
    # is config.text_config): the driver converts that sub-model alone, by this spec and its own config; the rest
    # (vision tower, projector, head) stays transformers' own, said once at convert. None: the whole model
    text_model: str = None
    # a token mixer kept as transformers' own (MixerSpec): the layers with a child of role "mixer" hold it instead of
    # their "attention" child, each layer exactly one of the two. None: every layer holds its attention
    mixer: object = None
    # children a layer may lack (Gemma 4's MoE router, experts and their norms, which config.enable_moe_block adds)
    optional: tuple = ()

    def __post_init__(self):
        bad = sorted({role for _, role in self.children} - set(ROLES))
        if any(role == "mixer" for _, role in self.children) != (self.mixer is not None):
            raise ValueError(f"model spec {self.model_types}: a child of role 'mixer' and ModelSpec.mixer go together")
        if any(role == "dropout" for _, role in self.children) and not self.dropout:
            raise ValueError(f"model spec {self.model_types}: a layer with dropout children needs dropout=True")
        if self.mlp.layout == "gate_up" and tuple(self.mlp.children) not in (GATE_UP_CHILDREN,
                                                                             GATE_UP_ACTIVATION_FN_CHILDREN):
            raise ValueError(f"model spec {self.model_types}: a gate_up MLP has the children {GATE_UP_CHILDREN} "
                             f"or {GATE_UP_ACTIVATION_FN_CHILDREN}")
        if self.mlp.layout == "packed_gate_up" and tuple(self.mlp.children) != PACKED_GATE_UP_CHILDREN:
            raise ValueError(f"model spec {self.model_types}: a packed_gate_up MLP has the children "
                             f"{PACKED_GATE_UP_CHILDREN}")
        if self.mlp.activation not in self.mlp.children:
            raise ValueError(f"model spec {self.model_types}: the MLP's activation child {self.mlp.activation!r} is "
                             f"not one of its children {self.mlp.children}")
        unknown = sorted(set(self.attention_optional) - set(self.attention_children) - set(self.qk_norm_children))
        if unknown:
            raise ValueError(f"model spec {self.model_types}: optional attention children {unknown} are not among "
                             f"its attention children {self.attention_children} or q/k norms {self.qk_norm_children}")
        if len(self.qk_norm_children) not in (1, 2, 3) or (len(self.qk_norm_children) == 3 and self.norm.keeps_stats):
            raise ValueError(f"model spec {self.model_types}: q/k norm children {self.qk_norm_children}: one norm for "
                             "q and k or one each, and a v norm only where the norms keep no statistics (rounding "
                             "'float32_scale')")
        if self.qk_norm not in QK_NORMS or self.norm.rounding not in NORM_ROUNDINGS:
            raise ValueError(f"model spec {self.model_types}: qk_norm {self.qk_norm!r} (one of {QK_NORMS}), norm "
                             f"rounding {self.norm.rounding!r} (one of {NORM_ROUNDINGS})")
        if bad or self.norm.kind not in NORMS or self.mlp.layout not in MLP_LAYOUTS or self.residual not in RESIDUALS:
            raise ValueError(f"model spec {self.model_types}: roles {bad or 'ok'}, norm {self.norm.kind!r}, MLP layout "
                             f"{self.mlp.layout!r}, residual {self.residual!r}; the driver knows roles {ROLES}, "
                             f"norms {NORMS}, MLP layouts {MLP_LAYOUTS} and residual forms {RESIDUALS}")

    def child(self, role):
        """The name of the layer's first child of `role` (None when it has none)."""
        return next((c for c, r in self.children if r == role), None)

    def count(self, role):
        """How many of the layer's children have `role`."""
        return sum(1 for _, r in self.children if r == role)

    @property
    def attention_all(self):
        """Every child the attention may hold: its own, and its q/k norms where it has them."""
        return self.attention_children + (self.qk_norm_children if self.qk_norm else ())


def llama_shaped(model_type, prefix, **overrides):
    """The spec of a Llama-shaped family: <prefix>DecoderLayer of input_layernorm -> self_attn (q/k/v/o_proj),
    post_attention_layernorm -> mlp (gate_proj, up_proj, down_proj, act_fn), <prefix>RMSNorm with offset 0,
    activation from config.hidden_act. `overrides` replace any field (e.g. qk_norm=True)."""
    fields = dict(model_types=(model_type,), layer=f"{prefix}DecoderLayer",
                  children=(("input_layernorm", "norm"), ("self_attn", "attention"),
                            ("post_attention_layernorm", "norm"), ("mlp", "mlp")),
                  norm=NormSpec("rmsnorm", f"{prefix}RMSNorm"), attention=f"{prefix}Attention",
                  attention_children=("q_proj", "k_proj", "v_proj", "o_proj"),
                  mlp=MLPSpec(f"{prefix}MLP", "gate_up", GATE_UP_CHILDREN))
    fields.update(overrides)
    return ModelSpec(**fields)


__all__ = ["GATE_UP_ACTIVATION_FN_CHILDREN", "GATE_UP_CHILDREN", "MLP_LAYOUTS", "PACKED_GATE_UP_CHILDREN", "QK_NORMS",
           "RESIDUALS", "ROLES", "MLPSpec", "MixerSpec", "ModelSpec", "NormSpec", "llama_shaped"]
