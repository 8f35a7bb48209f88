"""The one place selective_ckpt touches private names of transformers, bitsandbytes and PEFT.

Every read or write of an underscore name of theirs, and every match of one of their classes by name outside
the model specs, goes through a function or constant here; tests/test_compat.py checks that each name still
resolves on the installed versions and that no other module of the package reaches past this seam. Each entry
says which versions it was read from and what happens where the name is gone.

Nothing here imports transformers, PEFT or bitsandbytes at import time: fit's CLI and the eager layers run
without them (fit's CLI even hides bitsandbytes from PEFT).
"""

import importlib.metadata
import re

import torch

# The transformers releases the package is tested on: pyproject's [hf] extra pins the same range.
TRANSFORMERS_MIN = (5, 17)  # the GPU machine's transformers (bench/RESULTS.md)
TRANSFORMERS_BELOW = (5, 26)  # CI's is 5.25; the private names below were read there
TRANSFORMERS_RANGE = (f">={TRANSFORMERS_MIN[0]}.{TRANSFORMERS_MIN[1]},"
                      f"<{TRANSFORMERS_BELOW[0]}.{TRANSFORMERS_BELOW[1]}")


def transformers_version():
    """The installed transformers' version string, or None where it is not installed (read from its
    metadata, so nothing is imported)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def transformers_supported(version):
    """Whether a transformers `version` string lies in TRANSFORMERS_RANGE (by major.minor: a pre-release of the
    first release past the range is outside it)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and TRANSFORMERS_MIN <= (int(m[1]), int(m[2])) < TRANSFORMERS_BELOW


def unsupported_transformers():
    """None when transformers is missing or in the tested range; else the sentence saying the installed version
    and the range (the caller raises it as its own error)."""
    version = transformers_version()
    if version is None or transformers_supported(version):
        return None
    return (f"transformers {version} is installed; selective_ckpt supports transformers {TRANSFORMERS_RANGE} "
            f"(it reaches into names of transformers that change between releases): "
            f"pip install \"transformers{TRANSFORMERS_RANGE}\"")


# --- transformers: the attention and experts implementation a config names

def global_config_value(config, name, default=None):
    """config.`name` as one value for the whole model, or `default` where there is none: transformers' per-layer
    configs (Gemma 4's full layers with num_global_key_value_heads) refuse a global read of an attribute that
    varies by layer (read since 5.25; callers then read the layer's own modules)."""
    try:
        return getattr(config, name, default)
    except Exception as err:
        if type(err).__name__ == "AmbiguousGlobalPerLayerAttributeError":
            return default
        raise


def attention_implementation(config):
    """The attention implementation `config` runs now (a name in transformers' attention registry), or None."""
    # transformers 5.17-5.25: PretrainedConfig._attn_implementation (property over _internal); gone: None
    return getattr(config, "_attn_implementation", None)


_NOT_SET = object()


def eager_attention_implementation(config):
    """attention_implementation(config) for eager code only (not traced: it reads the instance dict as object does),
    without the Python levels of a config's attribute reads (its __getattribute__ overrides, the property): a check
    made at every training call of a layer."""
    # transformers 5.17-5.25: the _attn_implementation property returns _attn_implementation_internal, which its setter
    # writes into the instance dict; elsewhere (not in that dict) the property as attention_implementation reads it
    value = object.__getattribute__(config, "__dict__").get("_attn_implementation_internal", _NOT_SET)
    return attention_implementation(config) if value is _NOT_SET else value


def requested_attention_implementation(config):
    """The attention implementation set on `config` by the user (None: the model type's default)."""
    # transformers 5.17-5.25: PretrainedConfig._attn_implementation_internal; gone: None (the default)
    return getattr(config, "_attn_implementation_internal", None)


def set_attention_implementation(config, name):
    """Makes `config` (and its sub-configs) run attention implementation `name`, as a user does on a built model."""
    # transformers 5.17-5.25: the _attn_implementation setter (sub-configs too); gone: an unread attribute
    config._attn_implementation = name


def set_requested_attention_implementation(config, name):
    """Sets the implementation `config` names itself only (None: the model type's default), sub-configs left."""
    # transformers 5.17-5.25: PretrainedConfig._attn_implementation_internal; gone: an unread attribute
    config._attn_implementation_internal = name


def experts_implementation(config):
    """The experts implementation ("eager", "grouped_mm", "batched_mm") `config` runs, or None."""
    # transformers 5.17-5.25: PretrainedConfig._experts_implementation (property); gone: None ("eager" to us)
    return getattr(config, "_experts_implementation", None)


def requested_experts_implementation(config):
    """The experts implementation set on `config` by the user (None: from_pretrained's default)."""
    # transformers 5.17-5.25: PretrainedConfig._experts_implementation_internal; gone: None
    return getattr(config, "_experts_implementation_internal", None)


def names_experts_implementation(config):
    """Whether this transformers' configs name an experts implementation at all."""
    # transformers 5.17-5.25: PretrainedConfig._experts_implementation_internal; gone: False (nothing to set)
    return hasattr(config, "_experts_implementation_internal")


def set_experts_implementation(config, name):
    """Makes `config` (and its sub-configs) run experts implementation `name`."""
    # transformers 5.17-5.25: the _experts_implementation setter (sub-configs too); gone: an unread attribute
    config._experts_implementation = name


def set_requested_experts_implementation(config, name):
    """Sets the experts implementation `config` names itself only, sub-configs left."""
    # transformers 5.17-5.25: PretrainedConfig._experts_implementation_internal; gone: an unread attribute
    config._experts_implementation_internal = name


# --- transformers: modules and models

def layer_checkpoint_function(layer):
    """The checkpoint function transformers' checkpointing runs `layer`'s forward under (None: never set)."""
    # transformers 5.17-5.25: GradientCheckpointingLayer._gradient_checkpointing_func; gone: None (not ours)
    return getattr(layer, "_gradient_checkpointing_func", None)


def set_layer_checkpoint_function(layer, fn):
    """Has transformers' checkpointing run `layer`'s forward as fn(forward, *args) (when the layer's
    `gradient_checkpointing` is on)."""
    # transformers 5.17-5.25: GradientCheckpointingLayer._gradient_checkpointing_func; gone: an unread attribute
    layer._gradient_checkpointing_func = fn


# [the ContextVar of transformers' output capturing, or None]: looked up once (an import per call costs)
_COLLECTOR = []


def active_output_collector():
    """The outputs transformers' output capturing collects in the model forward running now ({"attentions": [...],
    "router_logits": [...]}, the names asked for), or None outside any model forward."""
    # transformers 5.17-5.25: transformers.utils.output_capturing._active_collector; gone: None (config decides)
    if _COLLECTOR:
        variable = _COLLECTOR[0]
    else:
        try:
            from transformers.utils.output_capturing import _active_collector as variable
        except ImportError:
            variable = None
        if not torch.compiler.is_compiling():  # remembered from eager code (a traced call leaves no side effect)
            _COLLECTOR.append(variable)
    if variable is None:
        return None
    if torch.compiler.is_compiling():
        # dynamo cannot trace ContextVar.get: the collector is a plain global once the model forward that sets it is
        # traced too (`compiling`); a layer traced on its own (an eager model around it) gets None
        return getattr(variable, "global_var", None) if getattr(variable, "compiling", False) else None
    return variable.get()


def is_output_capturing_hook(hook):
    """Whether `hook`, a module's forward hook, is one transformers' output capturing installed (it collects a
    module's output only while the running model forward's collector asks for it)."""
    # transformers 5.17-5.25: closures of transformers.utils.output_capturing.install_output_capuring_hook; gone:
    # every hook counts as the user's
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def own_loss_function(model):
    """The loss function set on this model instance (None: the class's, from its loss_type)."""
    # transformers 5.17-5.25: PreTrainedModel._loss_function (loss_function property's own); gone: None
    return vars(model).get("_loss_function")


def set_own_loss_function(model, fn):
    """Sets the loss function of this model instance; None removes it (the class's again)."""
    # transformers 5.17-5.25: PreTrainedModel._loss_function; gone: an unread attribute (the class's loss runs)
    if fn is None:
        vars(model).pop("_loss_function", None)
    else:
        model._loss_function = fn


def family_supports_sdpa(model_class):
    """Whether a PreTrainedModel class runs transformers' SDPA attention by default."""
    # transformers 5.17-5.25: PreTrainedModel._supports_sdpa; gone: True (transformers' default, SDPA)
    return getattr(model_class, "_supports_sdpa", True)


def upcast_reordered_attention(module):
    """GPT-2's upcast-and-reorder eager attention of `module` (bound), or None where the module has none."""
    # transformers 5.17-5.25: GPT2Attention._upcast_and_reordered_attn; gone: None (family's eager forward)
    return getattr(module, "_upcast_and_reordered_attn", None)


def is_expert_parallel(experts):
    """Whether a transformers experts module runs under expert parallelism."""
    # transformers 5.25: experts modules' _is_expert_parallel (5.17 has none); gone: False
    return getattr(experts, "_is_expert_parallel", False)


def expert_gate(experts):
    """The experts class's own gating method, or None where transformers has none by that name."""
    # transformers 5.25: GptOssExperts._apply_gate; gone: None
    return getattr(type(experts), "_apply_gate", None)


def has_own_expert_gating(experts):
    """Whether an experts module's class gates its experts' outputs its own way (not transformers' default)."""
    # transformers 5.17-5.25: experts class's _apply_gate vs integrations.moe._default_apply_gate; gone: False
    apply_gate = getattr(type(experts), "_apply_gate", None)
    return apply_gate is not None and apply_gate.__name__ != "_default_apply_gate"


# --- class names matched by name: bitsandbytes and fit's stand-ins (fit/simulate.py) share them, and matching by
# name needs no import of bitsandbytes (which fit's CLI hides)

# bitsandbytes 0.50: bitsandbytes.nn.Linear4bit, Linear8bitLt; renamed: not matched (kept as they are)
QUANTIZED_LINEARS = ("Linear4bit", "Linear8bitLt")
# bitsandbytes 0.50: bitsandbytes.nn.Params4bit, Int8Params; renamed: reported as unknown weights
QUANTIZED_PARAMETERS = ("Params4bit", "Int8Params")
# transformers 5.17-5.25: transformers.pytorch_utils.Conv1D (GPT-2's transposed Linear)
CONV1D = "Conv1D"
# peft 0.21: peft.tuners._buffer_dict.BufferDict; renamed: reported as an unknown module
PEFT_CONTAINERS = ("BufferDict",)
# peft 0.21: peft.tuners.lora's LoRA layers over a Linear, 4-bit, 8-bit base; renamed: unknown modules
PEFT_LORA_LINEARS = ("Linear", "Linear4bit", "Linear8bitLt")


def is_quantized_linear(module):
    """A bitsandbytes 4- or 8-bit Linear (or fit's stand-in of the 4-bit one)."""
    return type(module).__name__ in QUANTIZED_LINEARS


def is_4bit(obj):
    """A bitsandbytes 4-bit Linear or 4-bit weight (or fit's stand-in)."""
    return type(obj).__name__ in ("Linear4bit", "Params4bit")


def is_conv1d(module):
    return type(module).__name__ == CONV1D


def is_int8_linear(module):
    """bitsandbytes' own Linear8bitLt (not a LoRA layer of PEFT's by the same name)."""
    return type(module).__name__ == "Linear8bitLt" and type(module).__module__.startswith("bitsandbytes.")


def is_peft_lora_linear(cls):
    """One of PEFT's LoRA layer classes over a Linear base."""
    return cls.__module__.startswith("peft.tuners.lora") and cls.__name__ in PEFT_LORA_LINEARS


def is_modules_to_save(module):
    """PEFT's ModulesToSaveWrapper (modules_to_save: a trained copy per adapter of a module)."""
    # peft 0.21: peft.utils.other.ModulesToSaveWrapper; renamed: not matched (the loss head stays transformers')
    return type(module).__name__ == "ModulesToSaveWrapper"


def int8_input_holder(output):
    """The autograd node of a bitsandbytes 8-bit Linear's CPU/XPU training matmul (MatMul8bitFp) that holds the
    layer's input outside save_for_backward, when `output` has one and it holds the input; else None."""
    # bitsandbytes 0.50: autograd._functions.MatMul8bitFp's ctx.A (the input); gone: None (input kept as it is)
    node = output.grad_fn if isinstance(output, torch.Tensor) else None
    if node is not None and type(node).__name__ == "MatMul8bitFpBackward" and getattr(node, "A", None) is not None:
        return node
    return None


def drop_int8_input(node):
    """Drops the input reference of an int8_input_holder node (its backward reads it only for the weight's
    gradient)."""
    # bitsandbytes 0.50: MatMul8bitFp's ctx.A, read in backward only for the weight's gradient
    node.A = None
