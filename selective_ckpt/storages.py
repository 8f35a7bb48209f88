"""Which storage a tensor lives in: the one identity the layer pipeline, attention and the memory tools share.

A storage's identity is its StorageImpl (`untyped_storage()._cdata`), the same for every view of it. Unlike its
address (`data_ptr()`), it also tells storages apart on the meta device and under FakeTensorMode, where every
address is 0, so the same code runs on fake tensors (selective_ckpt.fit simulates a training step that way).
"""

import torch
from torch._subclasses.fake_tensor import FakeTensor

PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter, FakeTensor)  # no subclass: what the layer pipeline takes


def storage_id(t):
    """The identity of t's storage, or None for a tensor without one (a wrapper subclass, sparse)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_bytes(t):
    """The size in bytes of t's whole storage (what stays alive while any view of it does)."""
    return t.untyped_storage().nbytes()


def is_fake(t):
    """Whether t is a FakeTensor (no data: checks that read values are skipped for it)."""
    return isinstance(t, FakeTensor)
