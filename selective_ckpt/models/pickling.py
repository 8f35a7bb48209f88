"""Patched forwards that pickle: a converted model survives torch.save / torch.load and copy.deepcopy.

A patched module holds its new forward per instance. As a bound method (types.MethodType) it would
pickle as `getattr(module, function name)`, which the module's class does not have, so loading
failed. `BoundForward` is a bound method that pickles as (function, module): a module-level
function by its qualified name, a function made by a factory in this package (GPT-2's MLP forward
closes over its GELU approximation) by the factory's code and the closure's values. Loading a
converted Hugging Face model registers the "selective_ckpt" attention again, so a fresh process
runs the loaded model with the same kernels and keeps the same floor.
"""

import copy
import importlib
import inspect
import pickle
import sys
import types


class BoundForward:
    """`function` bound to `module` as its forward; behaves as the bound method and pickles."""

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
        original = getattr(self.module, "_selective_ckpt_forward", None)
        if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD] and original is not None:
            return inspect.signature(original)
        return sig

    def __repr__(self):
        return f"<patched forward {self.function.__qualname__} of {type(self.module).__name__}>"

    def __deepcopy__(self, memo):
        return BoundForward(self.function, copy.deepcopy(self.module, memo))

    def __reduce__(self):
        return _rebind, (_function_reference(self.function), self.module)


def _rebind(function, module):
    if "transformers" in sys.modules:  # a Hugging Face model: its config names our attention function
        from . import attention
        attention.register()
    return BoundForward(function, module)


def _function_reference(function):
    """`function` itself when pickle finds it by name, else a picklable recipe for a factory-made closure."""
    if isinstance(function, types.FunctionType) and "<locals>" in function.__qualname__:
        outer, _, rest = function.__qualname__.partition(".<locals>.")
        if "." in outer or "<locals>" in rest or not function.__module__.startswith(__package__.split(".")[0]):
            raise pickle.PicklingError(f"patched forward {function.__module__}.{function.__qualname__} cannot be "
                                       "pickled: only module-level functions and closures made by a module-level "
                                       "factory of selective_ckpt are")
        cells = tuple(c.cell_contents for c in function.__closure__ or ())
        return _ClosureRecipe(function.__module__, outer, function.__code__.co_qualname, cells,
                              function.__defaults__, function.__kwdefaults__)
    return function


class _ClosureRecipe:
    """Pickles as the closure it describes: loading gives the function itself."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return _closure, self.args


def _closure(module_name, factory_name, qualname, cells, defaults, kwdefaults):
    """The function `qualname` that the factory `factory_name` of `module_name` returns, with these cell values."""
    module = importlib.import_module(module_name)
    factory = getattr(module, factory_name)
    codes = [c for c in factory.__code__.co_consts if isinstance(c, types.CodeType) and c.co_qualname == qualname]
    if len(codes) != 1:
        raise pickle.UnpicklingError(f"{module_name}.{qualname} no longer exists; the model was saved by another "
                                     "version of selective_ckpt")
    function = types.FunctionType(codes[0], module.__dict__, codes[0].co_name, defaults,
                                  tuple(types.CellType(v) for v in cells))
    function.__kwdefaults__ = kwdefaults
    function.__qualname__ = qualname
    return function
