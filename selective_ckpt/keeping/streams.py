"""Where the offload engine's copies run: CUDA streams and events, or stand-ins that run on CPU tensors.

The engine (keeping.offload) orders its copies only through one of these objects, so the same ordering code runs
on a GPU, on plain CPU tensors and under FakeTensorMode. The interface is the few stream operations it needs:

    current()                     the stream the caller computes on
    new_stream(name)              a side stream ("d2h" or "h2d")
    wait_stream(waiter, other)    work queued on `waiter` from now on runs after all work queued on `other` so far
    record(stream) -> event       an event that completes after the work queued on `stream` so far
    query(event) -> bool          whether it has completed (never blocks)
    wait_event(stream, event)     work queued on `stream` from now on runs after `event`
    synchronize(event)            blocks the caller until `event` has completed
    copy(dst, src, stream)        dst.copy_(src), queued on `stream`
    empty_device(nbytes, device)  an uninitialised uint8 buffer, allocated on the current stream
    can_pin; pin(t) -> bool; unpin(t)   page-locking a host tensor's memory in place

SimulatedStreams runs side-stream copies late and poisons what a missing wait would let through, so a test on CPU
fails where a GPU would race.
"""

import collections
import ctypes
import functools
import os
import weakref

import torch

from ..storages import is_fake


class CudaStreams:
    """Real streams and events on one CUDA device; host memory is page-locked in place with cudaHostRegister."""

    can_pin = True

    def __init__(self, device):
        self.device = torch.device(device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name):
        return torch.cuda.Stream(self.device)

    def wait_stream(self, waiter, other):
        waiter.wait_stream(other)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def query(self, event):
        return event.query()

    def wait_event(self, stream, event):
        stream.wait_event(event)

    def synchronize(self, event):
        event.synchronize()

    def copy(self, dst, src, stream):
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def empty_device(self, nbytes, device):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def pin(self, t):
        if t.numel() == 0:
            return True
        cudart = torch.cuda.cudart()
        if cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0) == cudart.cudaError.success:
            return True
        _clear_cuda_error()
        return False

    def unpin(self, t):
        if t.numel():
            cudart = torch.cuda.cudart()
            if cudart.cudaHostUnregister(t.data_ptr()) != cudart.cudaError.success:
                _clear_cuda_error()


def _clear_cuda_error():
    """Resets the CUDA runtime's last error after a failed call torch does not check itself.

    Left set, the error of a failed cudaHostRegister would be reported by the next kernel launch check as that
    kernel's own. Only a runtime library already loaded into the process is used (it is the one torch calls).
    """
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=mode).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _copy(dst, src):
    # A fake tensor has no data to move, and on a torch built without CUDA copying into a fake CUDA tensor raises
    # ("not linked with support for cuda devices"): fake copies are counted, not run.
    if not is_fake(dst):
        dst.copy_(src)


class _Done:
    """The event of work that has already run."""

    __slots__ = ()


_DONE = _Done()


class SynchronousStreams:
    """Every copy runs at once on the calling thread, with nothing to pin: the engine on CPU tensors and under
    FakeTensorMode, where only its bookkeeping matters."""

    can_pin = False

    def current(self):
        return None

    def new_stream(self, name):
        return None

    def wait_stream(self, waiter, other):
        pass

    def record(self, stream):
        return _DONE

    def query(self, event):
        return True

    def wait_event(self, stream, event):
        pass

    def synchronize(self, event):
        pass

    def copy(self, dst, src, stream):
        _copy(dst, src)

    def empty_device(self, nbytes, device):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def pin(self, t):
        return False

    def unpin(self, t):
        pass


class _SimStream:
    """A side stream's queue: `issued` operations so far, the first `done` of them run."""

    __slots__ = ("name", "queue", "issued", "done")

    def __init__(self, name):
        self.name, self.queue, self.issued, self.done = name, collections.deque(), 0, 0


class _SimEvent:
    __slots__ = ("stream", "mark", "queries")

    def __init__(self, stream, mark):
        self.stream, self.mark, self.queries = stream, mark, 0


def _poison(t):
    """Fills t with what no correct copy produces: NaN for floats, all bits set otherwise (NaN read as any float)."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-1 if t.is_signed() else torch.iinfo(t.dtype).max)


class SimulatedStreams:
    """Side streams that run late, on CPU (or fake) tensors, so a missing wait or an early free shows in a test.

    The current stream runs its work at once. A copy issued on a side stream is queued and runs only when an event
    recorded after it is synchronized, waited on by the current stream, or has been queried `delay` times; a wait
    of one side stream on another is kept in order in the waiter's queue. A queued copy holds its source and
    destination by weak reference only: a source freed before the copy runs (dropped too early by its owner) makes
    the copy write poison (NaN) instead of data when `poison`; a destination freed first is counted in
    `dead_destinations`. A device buffer from `empty_device` and host memory passed to `pin` start as poison too,
    so reading either before the copy into it has run gives NaN. `pinnable=False` makes every pin fail (a host
    that cannot page-lock memory).

    Counters: `copies` and `bytes` per stream name, `waits` (stream and event waits), `blocking` (synchronize
    calls: the host waited), `pinned_bytes` (pinned now), `dead_sources`, `dead_destinations`, and `log`: the
    ("copy" | "wait" | "record", stream name, waited stream's name or None) of every operation in issue order.
    """

    can_pin = True

    def __init__(self, delay=2, poison=True, pinnable=True):
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 1:
            raise ValueError(f"delay must be an int >= 1, got {delay!r}")
        self.delay, self.poison, self.pinnable = delay, bool(poison), bool(pinnable)
        self.compute = _SimStream("compute")
        self.side = []
        self.copies, self.bytes = collections.Counter(), collections.Counter()
        self.waits = self.blocking = self.pinned_bytes = self.dead_sources = self.dead_destinations = 0
        self.log = []

    def current(self):
        return self.compute

    def new_stream(self, name):
        stream = _SimStream(name)
        self.side.append(stream)
        return stream

    def queued(self):
        """Operations issued on side streams that have not run yet."""
        return sum(s.issued - s.done for s in self.side)

    def wait_stream(self, waiter, other):
        self.waits += 1
        self.log.append(("wait", waiter.name, other.name))
        self._order(waiter, other, other.issued)

    def record(self, stream):
        self.log.append(("record", stream.name, None))
        return _SimEvent(stream, stream.issued)

    def query(self, event):
        if event.stream.done >= event.mark:
            return True
        event.queries += 1
        if event.queries >= self.delay:
            self._run(event.stream, event.mark)
            return True
        return False

    def wait_event(self, stream, event):
        self.waits += 1
        self.log.append(("wait", stream.name, event.stream.name))
        self._order(stream, event.stream, event.mark)

    def synchronize(self, event):
        self.blocking += 1
        self._run(event.stream, event.mark)

    def copy(self, dst, src, stream):
        self.copies[stream.name] += 1
        self.bytes[stream.name] += dst.numel() * dst.element_size()
        self.log.append(("copy", stream.name, None))
        if stream is self.compute:
            _copy(dst, src)
        else:
            self._enqueue(stream, functools.partial(self._late_copy, weakref.ref(dst), weakref.ref(src)))

    def empty_device(self, nbytes, device):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.poison:
            buffer.fill_(0xFF)
        return buffer

    def pin(self, t):
        if not self.pinnable:
            return False
        if self.poison:
            _poison(t)  # a host copy read before it was written reads NaN
        self.pinned_bytes += t.numel() * t.element_size()
        return True

    def unpin(self, t):
        self.pinned_bytes -= t.numel() * t.element_size()

    def _enqueue(self, stream, op):
        stream.queue.append(op)
        stream.issued += 1

    def _order(self, waiter, other, mark):
        if other is self.compute or other is waiter:
            return  # the current stream's work has already run
        if waiter is self.compute:
            self._run(other, mark)
        else:
            self._enqueue(waiter, functools.partial(self._run, other, mark))

    def _run(self, stream, mark):
        while stream.done < mark:
            op = stream.queue.popleft()
            stream.done += 1
            op()

    def _late_copy(self, dst_ref, src_ref):
        dst, src = dst_ref(), src_ref()
        if dst is None:
            self.dead_destinations += 1
        elif src is None:
            self.dead_sources += 1
            if self.poison:
                _poison(dst)
        else:
            _copy(dst, src)
