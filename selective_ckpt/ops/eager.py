"""Eager calls of the custom ops without the dispatcher's round trip.

A `torch.library.custom_op` call goes through the dispatcher: the autograd kernel, a redispatch below
autograd, the backend kernel, a dynamo-disabling wrapper and output-aliasing checks, about 40-100 us of
Python per call on a CPU (measured by bench.python_tax), several times what a small layer's kernels cost.
`fast_eager(op)` gives a custom op a direct path for plain eager calls: the op's own implementation, and
where the op has an autograd formula an autograd.Function made of the op's own setup_context and backward
(the generated node of the dispatcher path, without the dispatcher). Same functions, same kernels, same
saved tensors: outputs and gradients are bit-identical, and saved-tensor hooks (keeping.pipeline, the
memory ledger) see the same tensors in the same order.

The dispatcher path stays whenever it decides something: under torch.compile (dynamo, AOTAutograd), any
TorchDispatchMode but an observing one of TRANSPARENT_MODES alone (FakeTensorMode: the fit's simulated step and the ops' fake kernels; counting and
tracing modes), any TorchFunctionMode, functorch transforms (vmap, grad), meta tensors and tensor
subclasses (FakeTensor, DTensor, ...), keyword arguments, and an op without autograd formula called with
gradients needed (its node's backward then raises, as the dispatcher path makes it). The op object stays a
CustomOpDef (opcheck, register_fake, torch.ops.selective_ckpt.* are unchanged): only its class is a
subclass whose `__call__` picks the path.
"""

import inspect

import torch
from torch._library.custom_ops import CustomOpDef

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_function_modes = torch._C._is_torch_function_mode_enabled
_functorch_level = torch._C._functorch.peek_interpreter_stack
_any_requires_grad = torch._C._any_requires_grad
_increment_version = torch.autograd.graph.increment_version


# TorchDispatchMode classes that only observe (keeping.pipeline's cast watcher): the direct path may run under one
# of them alone; the ops' own aten calls then pass through it as the rest of the layer's do.
TRANSPARENT_MODES = set()


def eager_ok(args):
    """Whether a call on `args` may skip the dispatcher (see the module doc)."""
    if torch.compiler.is_compiling() or _function_modes() or _functorch_level() is not None:
        return False
    modes = _dispatch_modes()
    if modes and (modes > 1 or type(_dispatch_mode_at(0)) not in TRANSPARENT_MODES):
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or a.is_meta):
            return False
    return True


class _Direct:
    """One op's direct path: its implementation, defaults, mutated arguments and autograd.Function."""

    __slots__ = ("fn", "backward", "n", "defaults", "mutated", "function")

    def __init__(self, op):
        self.fn, self.backward = op._init_fn, op._backward_fn
        params = list(inspect.signature(self.fn).parameters.values())
        self.n = len(params)
        self.defaults = tuple(p.default for p in params)  # inspect.Parameter.empty where required
        schema = op._opoverload._schema
        self.mutated = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None
                             and a.alias_info.is_write)
        self.function = None
        backward, setup = op._backward_fn, op._setup_context_fn
        if backward is not None:
            fn = self.fn

            def forward(ctx, *args):
                out = fn(*args)
                if setup is not None:
                    setup(ctx=ctx, inputs=args, output=out)
                return out

            self.function = type(f"Eager_{op._name}", (torch.autograd.Function,), {
                "forward": staticmethod(forward), "backward": staticmethod(backward)})


class _EagerCustomOp(CustomOpDef):
    def __call__(self, *args, **kwargs):
        if kwargs or not eager_ok(args):
            return self._opoverload(*args, **kwargs)
        direct = self.__dict__.get("_eager_direct")
        if direct is None or direct.backward is not self._backward_fn:  # register_autograd since
            if len(self._backend_fns) > 1:  # a device-specific kernel: the dispatcher picks it
                return self._opoverload(*args)
            direct = self._eager_direct = _Direct(self)
        if len(args) != direct.n:
            if len(args) > direct.n or inspect.Parameter.empty in direct.defaults[len(args):]:
                return self._opoverload(*args)  # the dispatcher names what is wrong
            args = args + direct.defaults[len(args):]
        grad = torch.is_grad_enabled() and _any_requires_grad(*args)
        if direct.function is not None:
            if grad:
                return direct.function.apply(*args)
        elif grad:
            return self._opoverload(*args)  # no autograd formula: the dispatcher's node refuses backward
        out = direct.fn(*args)
        for i in direct.mutated:
            _increment_version(args[i])
        return out


def fast_eager(op):
    """Gives custom op `op` (a CustomOpDef) the direct eager path of the module doc; returns op."""
    if not isinstance(op, CustomOpDef):
        raise TypeError(f"fast_eager takes a torch.library.custom_op, got {type(op).__name__}")
    if type(op) is CustomOpDef:
        op.__class__ = _EagerCustomOp
    return op
