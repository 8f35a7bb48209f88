"""What a token mixer kept as transformers' own module (spec.MixerSpec: a Gated DeltaNet, a Mamba-2 mixer) saves for
backward: its own forward run on fake tensors, the storages its graph still holds afterwards counted once. No
kernel of ours reproduces such a mixer, so memory.estimate counts what this measures (memory.Mixer)."""

import weakref

import torch

from ..memory.ledger import graph_saved_tensors
from ..storages import storage_bytes, storage_id


class _Held:
    """What the fake run's pack hook hands autograd: alive exactly as long as the graph node that saved it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _run_fake(mixer, seq_len, batch, dtype, compute_dtype):
    """Bytes of the distinct storages the graph behind the mixer's output still holds after its forward: saved
    by a node the output reaches (a branch whose result is dropped, such as the final recurrent state, frees its
    nodes and what they saved), its input, parameters and buffers excluded."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = next(mixer.parameters()).device
    held = []

    def pack(t):
        # a detached alias: a node saving its own output would otherwise hold itself through the holder, a cycle
        # that keeps a dropped branch's nodes alive
        h = _Held(t.detach())
        held.append((weakref.ref(h), storage_id(t), storage_bytes(t)))
        return h

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        params = {n: mode.from_tensor(p) for n, p in mixer.named_parameters()}
        for n, p in mixer.named_parameters():
            params[n].requires_grad_(p.requires_grad)
        # buffers (Falcon-H1's MuP vector) are the module's, allocated before any forward, as its parameters are
        buffers = {n: mode.from_tensor(b) for n, b in mixer.named_buffers()}
        x = torch.empty(batch, seq_len, mixer.hidden_size, dtype=dtype, device=device, requires_grad=True)
        autocast = torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != dtype)
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor):
            y = torch.func.functional_call(mixer, {**params, **buffers}, (x,))
        skip = {storage_id(p) for p in (*params.values(), *buffers.values())} | {storage_id(x)}
        alive = {sid: nbytes for ref, sid, nbytes in held if ref() is not None and sid not in skip}
        alive.update(_unhooked(y, skip | {sid for _, sid, _ in held}))
        del y
    return sum(alive.values())


def _unhooked(y, known):
    """{storage: bytes} of what the graph behind y saved without passing the saved-tensor hooks: a Python number
    a tensor was multiplied by, kept as a 0-dim float64 tensor."""
    out = {}
    for t in graph_saved_tensors(y):
        sid = storage_id(t)
        if sid is not None and sid not in known:
            out[sid] = storage_bytes(t)
    return out


_MEASURED = {}  # (module shape, seq_len, batch, dtypes) -> bytes: the fake run depends on nothing else


def mixer_saved_bytes(mixer, seq_len, batch, dtype, compute_dtype=None):
    """Bytes `mixer`'s own forward keeps for backward (distinct storages, its input and parameters excluded) for
    a [batch, seq_len, hidden] input of `dtype`, under autocast to `compute_dtype` where that differs; found by
    running it on fake tensors, remembered per module shape."""
    compute_dtype = compute_dtype or dtype
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in mixer.named_parameters())
    key = (type(mixer), params, seq_len, batch, dtype, compute_dtype)
    if key not in _MEASURED:
        _MEASURED[key] = _run_fake(mixer, seq_len, batch, dtype, compute_dtype)
    return _MEASURED[key]
