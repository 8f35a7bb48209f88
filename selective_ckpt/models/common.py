"""What every model integration shares: the refusal type and parameter copying."""

import torch


class ConversionError(ValueError):
    """A module that convert() cannot change without changing what it computes."""


def factory(module):
    """device and dtype of a module's parameters, for building its replacement."""
    p = next(module.parameters())
    return {"device": p.device, "dtype": p.dtype}


@torch.no_grad()
def copy_param(dst, src, transpose=False):
    dst.copy_(src.t() if transpose else src)
    dst.requires_grad_(src.requires_grad)
