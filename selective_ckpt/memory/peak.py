"""Peak memory of a step on the CPU, as CUDA's max_memory_allocated counts it on the GPU.

`cpu_peak_bytes(fn)` is the CPU peak of what `fn` allocates (the profiler's allocator events);
`StorageTracker` follows live op outputs only (what custom ops allocate inside is invisible to it).
"""

import contextlib
import gc
import os
import sys
import weakref

import torch
from torch.utils._pytree import tree_flatten

from .ledger import storage_key


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's native logger prints start/stop lines on fd 2; keep them out of the report."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_allocation_deltas(fn):
    """Byte deltas (+ allocation, - free) of every CPU allocation while `fn()` runs, in time order.

    From the profiler (profile_memory=True), which sees allocations inside custom ops and C++
    kernels too. A free is seen when its block was allocated while some profiler ran, this call or
    an earlier one: a block an earlier measurement allocated and left alive (in a cache, say) shows
    up as a negative delta when it dies inside `fn`. So that garbage of earlier work is not such a
    block, it is collected first and no collection runs while `fn` does (what reference cycles made
    inside `fn` hold then counts, as it stays until a collection). Returns None where the profiler's
    raw events are not available.
    """
    from torch.profiler import ProfilerActivity, profile

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        if was_enabled:
            gc.enable()
    try:
        raw = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    return [n for _, n in sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")]


def running_peak(deltas):
    """Highest running sum of allocation deltas (0 if it never rises above the start)."""
    current = peak = 0
    for n in deltas:
        current += n
        peak = max(peak, current)
    return peak


def cpu_peak_bytes(fn):
    """Peak of CPU bytes allocated minus freed while `fn()` runs, from the allocator's own events.

    The running sum of `cpu_allocation_deltas` peaks at the figure CUDA's max_memory_allocated gives
    there. Memory freed inside `fn` that was allocated before it, outside any profiler, is not seen (set
    gradients to None beforehand). Falls back to StorageTracker (op outputs only) where the profiler's raw events are
    not available; `fn` then runs a second time.
    """
    deltas = cpu_allocation_deltas(fn)
    if deltas is not None:
        return running_peak(deltas)
    tracker = StorageTracker()
    with tracker:
        fn()
    return tracker.peak


class StorageTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of live tensor storage allocated while active (op outputs only).

    Every op's outputs are inspected; a storage not shared with the op's inputs (views and in-place
    results share theirs) is counted until it is freed, which a weakref finalizer on the storage
    reports. Storage that existed before (parameters, inputs) is not counted. Temporary buffers an
    op allocates and frees inside itself are invisible: this is the peak of tensors, the figure
    CUDA's max_memory_allocated gives minus allocator rounding and kernel workspaces.
    """

    def __init__(self):
        super().__init__()
        self.live = {}
        self.current = 0
        self.peak = 0

    def _free(self, key):
        n = self.live.pop(key, None)
        if n is not None:
            self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(a)[0] for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key, nbytes = storage_key(t)
            if key in inputs or key in self.live or key[0] == "id":
                continue
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(t.untyped_storage(), self._free, key)
        return out
