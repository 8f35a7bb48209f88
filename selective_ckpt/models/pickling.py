"""Patched forwards that pickle: how a patch's function is named in a pickle.

A patched forward (models/patching.py, `BoundForward`) pickles as (function, module): a module-level
function by its qualified name, a function made by a factory in this package (GPT-2's MLP forward
closes over its child names) by the factory's code and the closure's values. Loading a converted Hugging
Face model registers the "selective_ckpt" attention again (models/converted_layer.py), so a fresh process
runs the loaded model with the same kernels and keeps the same floor.
"""

import importlib
import pickle
import types


def function_reference(function):
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
