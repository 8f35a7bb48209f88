"""Finding a model's modules by class and checking them against a model spec, before anything changes: the
children a module may hold, an affine norm, an activation the kernels can apply and rebuild."""

from ..activations import elementwise_problem, kernel_activation
from .errors import ConversionError


def is_class(module, cls):
    """Whether `module` is exactly of `cls`: a class (not a subclass) or a class name."""
    return type(module) is cls if isinstance(cls, type) else type(module).__name__ == cls


def class_name(cls):
    return cls.__name__ if isinstance(cls, type) else cls


def modules_of(root, cls):
    """[(name, module)] of `root`'s modules exactly of `cls` (is_class), in module order."""
    return [(n, m) for n, m in root.named_modules() if is_class(m, cls)]


def check_children(module, name, allowed, model_type):
    """ConversionError when `module` holds a child outside `allowed`."""
    extra = sorted(set(dict(module.named_children())) - set(allowed))
    if extra:
        raise ConversionError(f"{name} ({type(module).__name__}, model type {model_type!r}): unexpected submodules "
                              f"{extra}; a converted block may hold only {sorted(allowed)}")


def check_present(module, name, required, model_type):
    """ConversionError when `module` lacks a child of `required`."""
    missing = [c for c in required if getattr(module, c, None) is None]
    if missing:
        raise ConversionError(f"{name} ({type(module).__name__}, model type {model_type!r}) lacks {missing}; a "
                              f"converted block holds {list(required)}")


def check_norm(norm, name, kind):
    if kind == "layernorm" and not getattr(norm, "elementwise_affine", True):
        raise ConversionError(f"{name}: {type(norm).__name__} is not an affine LayerNorm")


def check_activation(mlp, name, model_type, child):
    """ConversionError when the activation `mlp.<child>` can be neither applied by a kernel nor rebuilt
    faithfully as the elementwise module it is."""
    act = getattr(mlp, child)
    if kernel_activation(act) is None:
        problem = elementwise_problem(act)
        if problem is not None:
            raise ConversionError(f"{name} (model type {model_type!r}): its activation cannot be applied and rebuilt "
                                  f"faithfully: {problem}")
