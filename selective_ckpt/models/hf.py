"""Model specs and the one driver that converts a Hugging Face model in place from its spec.

A model spec (`ModelSpec`, one per model family in models/<family>.py as `SPEC`) says what a
decoder layer is: its class, its children and the role of each (norm, attention, MLP), the norm
kind and offset, the MLP layout and its activation child, the residual form,
whether attention holds q/k norms, and the shape reader the memory planner uses. `plan(root,
spec)` checks every block against the spec and returns (decoder layers, [(module, new forward),
...]) or raises ConversionError; `apply` then registers the attention function, points the config
at it, patches the forwards and wraps each decoder layer in its pipeline. A failed check
changes nothing.
"""

import dataclasses
import functools
import logging

from torch import nn

from .. import compat
from ..activations import elementwise_problem, kernel_activation
from ..memory.estimate import KEPT_MIXER
from ..validation import NORMS
from . import attention, hub_kernels, loss_head
from .converted_layer import announce_modes, convert_decoder_layer
from .errors import ConversionError
from .patches import (
    dropout_forward,
    fc_mlp_forward_factory,
    gate_up_mlp_forward,
    layer_norm_forward,
    own_forward_norm,
    packed_gate_up_mlp_forward,
    rms_norm_forward,
)
from .patching import patch_forward

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
_ACTIVATION_CHILD = {"gate_up": 3, "fc": 1, "packed_gate_up": 2}  # index of the activation in MLPSpec.children
# Residual forms the driver converts. Patching leaves the layer's own forward in place, so any form
# would compute right; the memory estimate (memory/estimate.py) counts what each keeps:
# "pre-norm": x + attn(norm(x)), then x1 + mlp(norm(x1));
# "parallel": attention and MLP both read the layer input (x + attn(norm(x)) + mlp(norm'(x)), one norm shared or
# one each); a spec's shape reader tells memory.estimate each layer's form (residual_shape);
# "post-norm" (OLMo2): x + norm(attn(x)), then x1 + norm(mlp(x1)): the norms' inputs are the o_proj and
# down_proj outputs, and x, x1 are what the projections read;
# "sandwich" (Gemma2/3): x1 = x + post_norm(attn(pre_norm(x))), y = x1 + post_norm(mlp(pre_norm(x1))), four
# norms, whose post-norms keep o_proj's and down_proj's outputs (post_norms=True).
RESIDUALS = ("pre-norm", "parallel", "post-norm", "sandwich")
# q/k norms (ModelSpec.qk_norm): per head over head_dim (Qwen3), or over the whole q_proj / k_proj output (OLMo2),
# both before RoPE (whose outputs attention reads, rebuilt: attention.qk_normed_forward), or per head on q and k
# after RoPE ("rotated", HunYuan: attention reads the norms' outputs, rebuilt)
QK_NORMS = (False, True, "projection", "rotated")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    kind: str  # "rmsnorm" (y = x * rstd * (offset + w)) or "layernorm" (affine, with or without bias)
    cls: object  # the norm's class name, or the class itself (matched exactly: nn.LayerNorm, not subclasses)
    offset: float = 0.0
    # "llama": w * T(x * rstd) (or Gemma's T(x * rstd * (offset + w))) by the fused kernel; "float32_scale":
    # T(w * (x * rstd)) scaled in float32 and rounded once (OLMo2), computed by the norm's own forward,
    # which keeps only x and runs again in backward (patches.own_forward_norm)
    rounding: str = "llama"


@dataclasses.dataclass(frozen=True)
class MLPSpec:
    cls: str  # class name
    layout: str  # one of MLP_LAYOUTS
    children: tuple  # gate_up: GATE_UP_CHILDREN (or ..._ACTIVATION_FN_); fc: (fc_in, activation, fc_out[, dropout])
    forward: object = None  # the MLP's patched forward (self, x); None: the layout's own


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
    shape: object  # shape reader (layer, config, spec) -> LayerShape fields (memory.planner)
    residual: str = "pre-norm"
    qk_norm: object = False  # attention holds q_norm and k_norm (of the spec's norm class): True per head,
    # "projection" over the whole q_proj / k_proj output, "rotated" per head after RoPE
    qk_norm_children: tuple = ("q_norm", "k_norm")  # the attention's q and k norm children, when qk_norm
    dropout: bool = False  # every nn.Dropout of the model keeps a seed instead of a mask
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
        if self.qk_norm not in QK_NORMS or self.norm.rounding not in ("llama", "float32_scale"):
            raise ValueError(f"model spec {self.model_types}: qk_norm {self.qk_norm!r} (one of {QK_NORMS}), norm "
                             f"rounding {self.norm.rounding!r} (\"llama\" or \"float32_scale\")")
        if bad or self.norm.kind not in NORMS or self.mlp.layout not in MLP_LAYOUTS or self.residual not in RESIDUALS:
            raise ValueError(f"model spec {self.model_types}: roles {bad or 'ok'}, norm {self.norm.kind!r}, MLP layout "
                             f"{self.mlp.layout!r}, residual {self.residual!r}; the driver knows roles {ROLES}, "
                             f"norms {NORMS}, MLP layouts {MLP_LAYOUTS} and residual forms {RESIDUALS}")


def hf_root(model):
    """The outermost transformers PreTrainedModel in `model` (itself, or inside a PEFT wrapper), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers missing: nothing of it can be in the model
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _is(module, cls):
    return type(module) is cls if isinstance(cls, type) else type(module).__name__ == cls


def _cls_name(cls):
    return cls.__name__ if isinstance(cls, type) else cls


def modules_of(root, cls):
    return [(n, m) for n, m in root.named_modules() if _is(m, cls)]


def check_children(module, name, allowed, model_type):
    extra = sorted(set(dict(module.named_children())) - set(allowed))
    if extra:
        raise ConversionError(f"{name} ({type(module).__name__}, model type {model_type!r}): unexpected submodules "
                              f"{extra}; a converted block may hold only {sorted(allowed)}")


def _check_norm(norm, name, spec):
    if spec.norm.kind == "layernorm" and not getattr(norm, "elementwise_affine", True):
        raise ConversionError(f"{name}: {type(norm).__name__} is not an affine LayerNorm")


def _mlp_activation(mlp, spec):
    return getattr(mlp, spec.mlp.children[_ACTIVATION_CHILD[spec.mlp.layout]])


def _check_activation(mlp, name, model_type, spec):
    act = _mlp_activation(mlp, spec)
    if kernel_activation(act) is None:
        problem = elementwise_problem(act)
        if problem is not None:
            raise ConversionError(f"{name} (model type {model_type!r}): its activation cannot be applied and rebuilt "
                                  f"faithfully: {problem}")


def text_path(root, spec):
    """Where `root` holds its text model: spec.text_model (in the composite's head class), else the longest dotted
    tail of it that names a submodule (in its base model: Mistral3Model's "language_model"); None for a
    whole-model spec or when none is there."""
    if spec.text_model is None:
        return None
    steps = spec.text_model.split(".")
    for i in range(len(steps)):
        path = ".".join(steps[i:])
        try:
            root.get_submodule(path)
        except AttributeError:
            continue
        return path
    return None


def text_part(root, spec, model_type=None):
    """The module `spec` converts in `root`: root itself, or a composite model's text decoder (text_path), a
    transformers model with a config of its own; ConversionError when `root` holds none there."""
    if spec.text_model is None:
        return root
    path = text_path(root, spec)
    part = root.get_submodule(path) if path is not None else None
    if getattr(part, "config", None) is None:
        raise ConversionError(f"{type(root).__name__} (model type {model_type!r}): no text model with a config at "
                              f"{spec.text_model!r} ({type(part).__name__ if part is not None else 'missing'}); "
                              "convert converts a composite model's text decoder there")
    return part


def left_as_is(root, spec):
    """[(name, module)] of a composite model's modules beside the path to its text model (text_path), in module
    order: what convert leaves transformers' own (the vision tower, the projector, the head). [] for a
    whole-model spec."""
    out, module, prefix = [], root, ""
    path = text_path(root, spec)
    for step in (path.split(".") if path else ()):
        out += [(prefix + n, m) for n, m in module.named_children() if n != step]
        module, prefix = getattr(module, step), f"{prefix}{step}."
    order = {n: i for i, (n, _) in enumerate(root.named_modules())}
    return sorted(out, key=lambda item: order[item[0]])


def plan(root, spec, model_type):
    """(decoder layers, [(module, forward), ...]) converting `root` by `spec`, or ConversionError. A composite
    model's spec (spec.text_model) plans its text model only (text_part)."""
    name = f"{type(root).__name__} (model type {model_type!r})"
    part = text_part(root, spec, model_type)
    if part is not root:
        name = (f"{type(root).__name__}.{text_path(root, spec)} ({type(part).__name__}, model type {model_type!r}, "
                f"text model type {getattr(part.config, 'model_type', None)!r})")
    root = part
    if spec.check is not None:
        spec.check(root, name)
    layers = modules_of(root, spec.layer)
    if not layers:
        raise ConversionError(f"{name} holds no {spec.layer}")
    expected = {"norm": spec.norm.cls, "attention": spec.attention, "mlp": spec.mlp.cls, "dropout": nn.Dropout}
    attention_children = spec.attention_children + (spec.qk_norm_children if spec.qk_norm else ())
    mixers = ("attention", "mixer") if spec.mixer is not None else ()
    expected["mixer"] = spec.mixer.cls if spec.mixer is not None else None
    for lname, layer in layers:
        check_children(layer, lname, [c for c, _ in spec.children], model_type)
        held = [c for c, role in spec.children if role in mixers and c in layer._modules]
        if mixers and len(held) != (2 if spec.mixer.beside_attention else 1):
            names = [c for c, role in spec.children if role in mixers]
            raise ConversionError(f"{lname} ({type(layer).__name__}, model type {model_type!r}) holds {held or 'none'} "
                                  f"of its token mixers {names}; a converted layer holds "
                                  f"{'both' if spec.mixer.beside_attention else 'exactly one'}")
        for child, role in spec.children:
            if role in mixers and child not in held:
                continue
            if child in spec.optional and child not in layer._modules:
                continue
            if role == "own":  # the spec's check verifies it
                continue
            module = getattr(layer, child)
            if not _is(module, expected[role]) and not (role == "mlp" and spec.moe and _is(module, spec.moe.block)):
                raise ConversionError(f"{lname}.{child} (model type {model_type!r}) is a {type(module).__name__}, not "
                                      f"{_cls_name(expected[role])}; it cannot be converted")
            if role == "norm":
                _check_norm(module, f"{lname}.{child}", spec)
            elif role == "mlp" and spec.moe is not None and _is(module, spec.moe.block):
                spec.moe.check_block(module, f"{lname}.{child}", model_type, spec.mlp.cls)
            elif role == "attention":
                check_children(module, f"{lname}.{child}", attention_children, model_type)
            elif role == "dropout":
                if not spec.dropout:
                    raise ValueError(f"model spec {spec.model_types}: a dropout child needs dropout=True")
            elif role == "mlp":
                check_children(module, f"{lname}.{child}", spec.mlp.children, model_type)
                _check_activation(module, f"{lname}.{child}", model_type, spec)
    qk_norms = set()
    if spec.qk_norm:
        attn = _child_of_role(spec, "attention")
        # a family whose q/k norms are optional by config (GLM-4.5's use_qk_norm) may have none
        qk_norms = {id(m) for _, layer in layers for n in spec.qk_norm_children
                    if (m := getattr(getattr(layer, attn, None), n, None)) is not None}
    patches = [(m, _norm_forward(spec.norm, "qkv" if id(m) in qk_norms else "residual"))
               for _, m in modules_of(root, spec.norm.cls)]
    if spec.dropout:
        dropouts = [m for m in root.modules() if type(m) is nn.Dropout]
        if any(d.inplace for d in dropouts):
            raise ConversionError(f"{name}: in-place nn.Dropout cannot be converted")
        patches += [(m, dropout_forward) for m in dropouts]
    patches += [(m, spec.mlp.forward or _mlp_forward(spec.mlp)) for _, m in modules_of(root, spec.mlp.cls)]
    own = spec.patches(root) if spec.patches is not None else []
    if spec.qk_norm in (True, "projection"):  # norms before RoPE: RoPE's outputs rebuilt too (attention.py)
        attn, mine = _child_of_role(spec, "attention"), {id(m) for m, _ in own}
        for lname, layer in layers:
            module = getattr(layer, attn, None)
            if id(getattr(module, spec.qk_norm_children[0], None)) in qk_norms and id(module) not in mine:
                attention.check_rope_rebuild(module, f"{lname}.{attn}")
                patches.append((module, attention.qk_normed_forward))
    patches += own
    if spec.moe is not None:
        patches += spec.moe.patches(root)
    return [m for _, m in layers], patches


def _norm_forward(norm, kept="residual"):
    """The patched forward of a norm whose input is of class `kept` (keeping.policy) when nothing named it."""
    if norm.rounding == "float32_scale":
        forward = own_forward_norm
    elif norm.kind == "layernorm":
        forward = layer_norm_forward
    elif norm.offset == 0:
        forward = rms_norm_forward
    else:
        forward = functools.partial(rms_norm_forward, offset=float(norm.offset))
    return forward if kept == "residual" else functools.partial(forward, kept=kept)


def _mlp_forward(mlp):
    if mlp.layout == "gate_up":
        return gate_up_mlp_forward
    if mlp.layout == "packed_gate_up":
        return packed_gate_up_mlp_forward
    fc_in, act, fc_out, *dropout = mlp.children
    return fc_mlp_forward_factory(fc_in, act, fc_out, dropout[0] if dropout else None)


def layer_activation(layer, spec):
    """The LayerShape activation of a converted layer's MLP: what memory.estimate counts for it.

    A gated MLP keeps gate and up whatever its activation ("swiglu" for SiLU, "geglu" for any
    other); a plain one keeps its fc_in output ("gelu_tanh" for tanh-GELU, "gelu" for any other).
    """
    kernel = kernel_activation(_mlp_activation(getattr(layer, _child_of_role(spec, "mlp")), spec))
    if spec.mlp.layout in ("gate_up", "packed_gate_up"):
        return "swiglu" if kernel == "silu" else "geglu"
    return "gelu_tanh" if kernel == "gelu_tanh" else "gelu"


def _child_of_role(spec, role):
    return next(c for c, r in spec.children if r == role)


def mlp_child(spec):
    """The name of a decoder layer's MLP child under `spec`."""
    return _child_of_role(spec, "mlp")


def config_shape(layer, config, spec):
    """LayerShape fields of a decoder layer from the model's config: hidden_size, num_attention_heads,
    num_key_value_heads, intermediate_size (or GPT-2's n_inner, 4 h by default), the attention's
    head_dim (given only where heads x head_dim is not hidden_size) and sliding_window."""
    attn = getattr(layer, _child_of_role(spec, "attention"))
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(attn, "head_dim", h // heads)
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    kv = compat.global_config_value(config, "num_key_value_heads") or heads  # per layer: the shape reader's
    fields = dict(hidden_dim=h, num_heads=heads, num_kv_heads=kv, ffn_dim=ffn, mlp_ratio=ffn / h, norm=spec.norm.kind,
                  activation=layer_activation(layer, spec),
                  sliding_window=getattr(attn, "sliding_window", None) or None)
    if head_dim * heads != h:
        fields["head_dim"] = head_dim
    if spec.qk_norm:
        fields["qk_norm"] = spec.qk_norm  # the q/k norms keep their inputs and statistics (memory.estimate)
    if spec.residual == "sandwich":
        fields["post_norms"] = True  # the post-norms keep o_proj's and down_proj's outputs and statistics
    return fields


def residual_shape(layer, config, spec, parallel=None):
    """config_shape plus the layer's residual form and norm count for memory.estimate: "parallel" when the
    spec's residual is (or `parallel`, a layer's own flag, says so), norms = the layer's norm children."""
    parallel = spec.residual == "parallel" if parallel is None else parallel
    norms = sum(1 for _, role in spec.children if role == "norm")
    return {**config_shape(layer, config, spec), "residual": "parallel" if parallel else "pre-norm", "norms": norms}


def llama_shaped(model_type, prefix, **overrides):
    """The spec of a Llama-shaped family: <prefix>DecoderLayer of input_layernorm -> self_attn (q/k/v/o_proj),
    post_attention_layernorm -> mlp (gate_proj, up_proj, down_proj, act_fn), <prefix>RMSNorm with offset 0,
    activation from config.hidden_act. `overrides` replace any field (e.g. qk_norm=True)."""
    fields = dict(model_types=(model_type,), layer=f"{prefix}DecoderLayer",
                  children=(("input_layernorm", "norm"), ("self_attn", "attention"),
                            ("post_attention_layernorm", "norm"), ("mlp", "mlp")),
                  norm=NormSpec("rmsnorm", f"{prefix}RMSNorm"), attention=f"{prefix}Attention",
                  attention_children=("q_proj", "k_proj", "v_proj", "o_proj"),
                  mlp=MLPSpec(f"{prefix}MLP", "gate_up", GATE_UP_CHILDREN),
                  shape=config_shape)
    fields.update(overrides)
    return ModelSpec(**fields)


def apply(root, layers, patches, mode, spec):
    """Registers attention, patches the forwards and gives each decoder layer its recompute mode ("full" for a
    layer under transformers' checkpointing already) and its shape reader (its LayerShape fields for the memory
    planner), and installs the fused loss head on a causal LM (models/loss_head.py). A composite model's spec
    (spec.text_model): attention and the shapes are its text model's (text_part), whose config alone names the
    attention; the modules left transformers' own are said once (one info line on the selective_ckpt logger)."""
    part = text_part(root, spec)
    attention.register(part)  # records the attention the model ran before, which fully masked rows follow
    part.config._attn_implementation = attention.NAME  # a composite's top config would set its vision config's too
    for module, forward in patches:
        patch_forward(module, forward)
    hub_kernels.keep_patches(root)
    names = {id(m): n for n, m in root.named_modules()}
    for layer in layers:
        convert_decoder_layer(layer, mode, functools.partial(spec.shape, config=part.config, spec=spec),
                              names.get(id(layer)), _child_of_role(spec, "mlp"))
    announce_modes(layers)
    if spec.mixer is not None:
        _say_mixers(root, spec, layers, names)
    loss_head.install(root)
    if part is not root:
        _say_left_as_is(root, spec, part)


def _say_mixers(root, spec, layers, names):
    """Marks each kept mixer (KEPT_MIXER) and says once which layers keep which module as transformers' own, and
    why: one info line on the selective_ckpt logger."""
    child = next(c for c, role in spec.children if role == "mixer")
    held = [(i, getattr(layer, child)) for i, layer in enumerate(layers) if child in layer._modules]
    for _, mixer in held:
        setattr(mixer, KEPT_MIXER, spec.mixer.why)
    if held:
        logging.getLogger("selective_ckpt").info(
            f"selective_ckpt: {type(root).__name__} (model type {getattr(root.config, 'model_type', None)!r}): "
            f"decoder layers {', '.join(str(i) for i, _ in held)} of {len(layers)} keep their {child} "
            f"({spec.mixer.cls}) as transformers' own, and what it saves for backward: {spec.mixer.why}; their "
            f"{'attention, ' if spec.mixer.beside_attention else ''}norms and MLP convert")


def _say_left_as_is(root, spec, part):
    left = ", ".join(f"{n} ({type(m).__name__})" for n, m in left_as_is(root, spec))
    head = "" if loss_head.is_causal_lm(root) else "; its loss is transformers' own (lm_head's logits are made)"
    logging.getLogger("selective_ckpt").info(
        f"selective_ckpt: {type(root).__name__} (model type {getattr(root.config, 'model_type', None)!r}): converted "
        f"its text model {text_path(root, spec)} ({type(part).__name__}); left as transformers' own: {left}: the "
        f"model spec converts the text decoder's layers only{head}")


__all__ = ["ConversionError", "KEPT_MIXER", "MLPSpec", "MixerSpec", "ModelSpec", "NormSpec", "apply", "config_shape",
           "hf_root", "left_as_is", "llama_shaped", "plan", "residual_shape", "text_part", "text_path"]
