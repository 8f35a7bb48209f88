"""The one table of activation names, and which activation module computes which kernel activation.

The kernels compute three activations: "silu", "gelu" (exact, erf) and "gelu_tanh" (the tanh
approximation). `ACTIVATIONS` maps every name the package accepts to one of them: transformers'
ACT2FN names (a model config's `hidden_act`, GPT-2's `activation_function`) and the names of
SelectiveDecoderLayer's `activation` argument, of which "swiglu" and "geglu" build the gated MLP
act(gate) * up and the others the plain MLP act(fc1).

`kernel_activation(module)` is how a patched model MLP decides between the kernels and calling
its own activation module: the kernel activation only for a module of the exact class (and
configuration) transformers or torch build for a name in the table, with no hooks of its own.
"""

import functools

from torch import nn

KERNEL_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

ACTIVATIONS = {
    # transformers.activations.ACT2FN names
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    # SelectiveDecoderLayer's own names ("gelu" above is its exact-GELU MLP)
    "gelu_tanh": "gelu_tanh",
    "swiglu": "silu",
    "geglu": "gelu_tanh",
}

LAYER_ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu")  # SelectiveDecoderLayer(activation=...)
GATED_LAYER_ACTIVATIONS = ("swiglu", "geglu")

# Kernel activation -> the `approximate` argument of the GELU op (ops/gelu_mlp.py).
GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}


def has_own_hooks(module):
    """Whether hooks are registered on this module itself (global module hooks are not counted)."""
    return any(getattr(module, attr, None) for attr in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _config(module):
    """The module's own attributes, with functions, bound methods and partials made comparable."""
    def norm(v):
        if isinstance(v, functools.partial):
            return ("partial", norm(v.func), v.args, tuple(sorted(v.keywords.items())))
        return getattr(v, "__func__", v)

    return {k: norm(v) for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


_REFERENCES = None


def _references():
    """(class, configuration, kernel activation) of the modules that stand for a table name, made once. A global
    holds them rather than functools.cache, through which torch.compile traces with a warning (kernel_activation
    runs in a patched MLP's forward)."""
    global _REFERENCES
    if _REFERENCES is None:
        _REFERENCES = _make_references()
    return _REFERENCES


def _make_references():
    out = [(nn.SiLU, _config(nn.SiLU()), "silu"), (nn.GELU, _config(nn.GELU()), "gelu"),
           (nn.GELU, _config(nn.GELU(approximate="tanh")), "gelu_tanh")]
    try:
        from transformers.activations import ACT2CLS, ACT2FN
    except ImportError:  # no transformers: only torch's modules
        return tuple(out)
    for name, kernel in ACTIVATIONS.items():
        entry = ACT2CLS.get(name)
        if entry is not None and not isinstance(entry, tuple):  # (class, kwargs) entries are other variants
            module = ACT2FN[name]
            out.append((type(module), _config(module), kernel))
    return tuple(out)


def kernel_activation(module):
    """The kernel activation `module` computes, or None where the module itself must be called: a class
    or configuration outside the table, or hooks on the module."""
    if has_own_hooks(module):
        return None
    config = None
    for cls, ref, kernel in _references():
        if type(module) is cls:
            config = _config(module) if config is None else config
            if config == ref:
                return kernel
    return None


# Modules in these modules are elementwise and deterministic unless listed in _NOT_ELEMENTWISE.
_ELEMENTWISE_SOURCES = ("torch.nn.modules.activation", "transformers.activations")
_NOT_ELEMENTWISE = ("Softmax", "Softmin", "LogSoftmax", "Softmax2d", "GLU", "MultiheadAttention", "RReLU")


def elementwise_problem(module):
    """Why `module` cannot be called as an MLP's activation and rebuilt from its input in backward
    (None when it can): it must be a deterministic elementwise activation of torch.nn or
    transformers.activations without submodules."""
    cls = type(module)
    if cls.__module__ not in _ELEMENTWISE_SOURCES or cls.__name__ in _NOT_ELEMENTWISE:
        return (f"{cls.__module__}.{cls.__name__} is not a deterministic elementwise activation of torch.nn or "
                "transformers.activations")
    if next(module.children(), None) is not None:
        return f"{cls.__name__} holds submodules"
    return None
