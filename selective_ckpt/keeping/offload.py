"""Offloading a layer's saved tensors to host memory in forward and loading them back before its backward.

The layer pipeline (keeping.pipeline) hands each saved tensor of an offloaded class to `OffloadEngine.offload` in
its pack hook, and calls `get()` on the returned handle in its unpack hook. The rules (docs/DESIGN.md, "Offload
rules"):

- Groups. The tensors saved between two `begin_layer()` calls are one group: one layer's forward. A group's copies
  out (device to host, D2H) are issued when the next layer begins, so they overlap that layer's compute; the group
  still open when backward starts is never copied. Views of one storage in a group (k and v of one packed qkv
  buffer, a tensor saved by two nodes) share one copy of the whole storage, and each is rebuilt as a view of it.
- Streams. D2H runs on its own stream after the compute stream's work so far; host to device (H2D) on another,
  into a buffer allocated on the compute stream, and `get()` makes the compute stream wait for the copy's event.
- No record_stream, no early free. What a copy in flight reads or writes is held by the engine until the copy's
  event has completed, checked without blocking ("reaped") whenever the engine is called: record_stream would
  delay frees to an unknown later point and fragment the allocator. Once its D2H has completed, an entry drops its
  device source, which is the memory offloading saves.
- Prefetch. The first `get()` in a group loads that group and the `prefetch` groups offloaded before it, so the
  next layer's tensors arrive while this layer's backward runs.
- Host memory comes from one arena (HostArena), page-locked in place.
- A forward without backward leaves nothing behind: handles die with the graph, groups hold their entries weakly,
  what copies in flight hold is dropped when they complete, and nothing blocks on a stream.

Where copies run is a streams object (keeping.streams): CUDA streams for CUDA tensors, immediate copies for CPU
and fake tensors, or SimulatedStreams in tests.
"""

import threading
import warnings
import weakref

import torch

from ..storages import PLAIN_TENSOR_TYPES, is_fake, storage_id
from .streams import CudaStreams, SynchronousStreams

ALIGN = 512  # bytes: where arena slots start
_STREAM_METHODS = ("current", "new_stream", "wait_stream", "record", "query", "wait_event", "synchronize", "copy",
                   "empty_device", "pin", "unpin")
_OPEN, _KEPT, _OFFLOADED = "open", "kept", "offloaded"


def _align(n):
    return -(-n // ALIGN) * ALIGN


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class _Slot:
    """Host bytes for one copy; given back to the arena when its last holder (an entry, a copy in flight) drops it."""

    __slots__ = ("arena", "tensor", "nbytes", "own")

    def __init__(self, arena, tensor, nbytes, own):
        self.arena, self.tensor, self.nbytes, self.own = arena, tensor, nbytes, own

    def __del__(self):
        self.arena.release(self)


class HostArena:
    """Host memory for copies out: one uint8 buffer carved by a bump pointer, slots aligned to ALIGN bytes.

    The pointer returns to 0 whenever no slot is held. A slot that does not fit is a host tensor of its own, and
    the most the arena would have needed (its high-water mark) is remembered: at the next return to 0 the arena is
    reallocated at exactly that size, so from the second step on one allocation serves every step. Memory is
    allocated pageable and page-locked in place: torch's pinned allocator would round each request up to a power
    of two. When page-locking fails the arena warns once and goes on pageable, or raises when `strict`.
    """

    def __init__(self, capacity, pin, strict):
        self.pin, self.strict = pin, strict
        self.streams = None
        self.buffer, self.capacity, self.pinned = None, 0, False
        self.high_water = capacity  # the first return to 0 allocates the requested size
        self.top = 0  # where the next slot would start if the arena were large enough
        self.live_slots = self.live_bytes = self.peak = self.allocations = 0
        self._lock = threading.RLock()  # slots are released by __del__, on whichever thread drops them

    def start(self, streams):
        self.streams = streams
        with self._lock:
            if self.live_slots == 0:
                self._reset()

    def slot(self, nbytes):
        """A _Slot of nbytes host bytes."""
        with self._lock:
            if self.live_slots == 0:
                self._reset()
            start = _align(self.top)
            self.top = start + nbytes
            self.high_water = max(self.high_water, self.top)
            if self.top <= self.capacity:
                tensor, own = self.buffer[start:self.top], False
            else:
                tensor = torch.empty(nbytes, dtype=torch.uint8)
                own = self._pin(tensor)
                self.allocations += 1
            self.live_slots += 1
            self.live_bytes += nbytes
            self.peak = max(self.peak, self.live_bytes)
        return _Slot(self, tensor, nbytes, own)

    def release(self, slot):
        with self._lock:
            self.live_slots -= 1
            self.live_bytes -= slot.nbytes
        if slot.own:
            self.streams.unpin(slot.tensor)

    def close(self):
        with self._lock:
            self._free()
            self.high_water = 0

    def _reset(self):
        self.top = 0
        if self.high_water > self.capacity:
            self._free()
            self.buffer = torch.empty(self.high_water, dtype=torch.uint8)
            self.capacity = self.high_water
            self.allocations += 1
            self.pinned = self._pin(self.buffer)

    def _free(self):
        if self.pinned:
            self.streams.unpin(self.buffer)
        self.buffer, self.capacity, self.pinned = None, 0, False

    def _pin(self, tensor):
        if not (self.pin and self.streams.can_pin and tensor.numel()):
            return False
        if self.streams.pin(tensor):
            return True
        failed = f"page-locking {tensor.numel()} bytes of host memory in place (cudaHostRegister) failed"
        if self.strict:
            raise RuntimeError(f"{failed}, and strict=True forbids pageable copies: raise the host's locked-memory "
                               "limit, lower the host budget, or pass strict=False")
        warnings.warn(f"{failed}, as under a cap on locked memory (WSL2) or on a full host: offloaded copies now use "
                      "pageable memory, which makes them slower and nearly synchronous with the host. Pass "
                      "strict=True to make this an error.", RuntimeWarning, stacklevel=2)
        self.pin = False  # warned once; the rest of the run is pageable
        return False


class _Entry:
    """One storage saved in one group: its device source until the copy out has completed, its host copy, and the
    buffer it was loaded back into."""

    __slots__ = ("group", "nbytes", "src", "slot", "d2h_event", "buf", "h2d_event", "__weakref__")

    def __init__(self, group, src):
        self.group, self.src, self.nbytes = group, src, src.numel()
        self.slot = self.d2h_event = self.buf = self.h2d_event = None


class _Group:
    """The storages one layer's forward saved, held weakly: a dropped graph frees them."""

    __slots__ = ("index", "entries", "state", "loaded")

    def __init__(self, index):
        self.index, self.entries, self.state, self.loaded = index, weakref.WeakValueDictionary(), _OPEN, False

    def live(self):
        return list(self.entries.values())


class _Copies:
    """Copies issued together on one stream: the tensors and slots they touch stay alive until `event` completes,
    then `finish` runs on each entry still alive."""

    __slots__ = ("event", "tensors", "slots", "entries", "finish")

    def __init__(self, event, tensors, slots, entries, finish):
        self.event, self.tensors, self.slots, self.finish = event, tensors, slots, finish
        self.entries = [weakref.ref(e) for e in entries]

    def done(self):
        for ref in self.entries:
            entry = ref()
            if entry is not None:
                self.finish(entry)


def _copied_out(entry):
    entry.src, entry.d2h_event = None, None  # the host copy is complete: the device memory can go


def _copied_in(entry):
    entry.h2d_event = None


def _shut_down(streams, pending, arena):
    """Waits for every copy in flight, then releases the arena (close(), or the engine collected unclosed)."""
    for copies in pending:
        streams.synchronize(copies.event)
    pending.clear()
    arena.close()


class OffloadHandle:
    """What a saved-tensor pack hook keeps instead of a tensor: its storage's entry and the view's geometry."""

    __slots__ = ("engine", "entry", "dtype", "size", "stride", "offset")

    def __init__(self, engine, entry, t):
        self.engine, self.entry = engine, entry
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()

    def get(self):
        """The saved tensor, bit-identical, as a view of a device buffer holding its whole storage."""
        return self.engine._get(self)

    @property
    def offloaded(self):
        """Whether its storage was copied out (every layer's but the one still open when backward began)."""
        return self.entry.group.state == _OFFLOADED or self.entry.slot is not None


class _KeptHandle:
    """A tensor without a plain strided storage (a wrapper subclass, sparse): kept as it is."""

    __slots__ = ("tensor",)

    def __init__(self, t):
        self.tensor = t.detach()  # an alias without the graph, so the handle makes no cycle through its node

    def get(self):
        return self.tensor

    offloaded = False


class OffloadEngine:
    """Copies the tensors a layer's forward saves to host memory and loads them back before its backward.

    prefetch: how many earlier offloaded groups the first read of a group loads as well (0: none).
    host_bytes: the arena's size to start with; None starts empty and sizes it from the first step.
    pin: page-lock host memory (copies then overlap compute); strict: raise instead of going on pageable when
    page-locking fails. streams: where copies run (keeping.streams); None picks CudaStreams for CUDA tensors and
    SynchronousStreams for CPU and fake tensors, on the first tensor offloaded.

    One engine serves one device. `stats()` reports host bytes held, the arena's size, bytes copied each way and
    copies in flight; `synchronize()` waits for every copy in flight; `close()` releases the arena.
    """

    def __init__(self, prefetch=1, host_bytes=None, pin=True, strict=False, streams=None):
        _check_count("prefetch", prefetch)
        if host_bytes is not None:
            _check_count("host_bytes", host_bytes)
        for name, value in (("pin", pin), ("strict", strict)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        if streams is not None:
            missing = [m for m in _STREAM_METHODS if not callable(getattr(streams, m, None))]
            if missing or not hasattr(streams, "can_pin"):
                raise TypeError(f"streams must provide {', '.join(_STREAM_METHODS)} and can_pin "
                                f"(keeping.streams); {type(streams).__name__} lacks {', '.join(missing) or 'can_pin'}")
        self.prefetch = prefetch
        self._arena = HostArena(host_bytes or 0, pin, strict)
        self._streams = self._d2h = self._h2d = self._device = self._finalizer = None
        self._groups = {}  # index -> _Group in creation order: the open one and those that may hold entries
        self._open = None
        self._next = 0
        self._pending = []  # _Copies in flight
        self._d2h_bytes = self._h2d_bytes = 0
        self._closed = False
        if streams is not None:
            self._start(streams)

    # --- forward

    def begin_layer(self):
        """A layer's forward starts: the previous layer's group is copied out, and a new group opens."""
        self._check_usable()
        self._reap()
        group = self._open
        if group is not None and group.state == _OPEN:
            self._offload(group)
        self._open = self._new_group()
        self._prune()

    def offload(self, t):
        """A handle for t, saved in the open group; `handle.get()` gives t back."""
        self._check_usable()
        key = storage_id(t) if type(t) in PLAIN_TENSOR_TYPES and t.layout == torch.strided else None
        if key is None:
            return _KeptHandle(t)
        if self._device is None:
            self._bind(t)
        elif t.device != self._device:
            raise RuntimeError(f"this offload engine serves {self._device}; got a tensor on {t.device}")
        self._reap()
        group = self._open if self._open is not None else self._new_group()
        self._open = group
        # The entry holds the storage, so while it lives its identity cannot be reused by another storage.
        entry = group.entries.get(key)
        if entry is None:
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            entry = group.entries[key] = _Entry(group, src)
        return OffloadHandle(self, entry, t)

    # --- backward

    def _get(self, handle):
        self._check_usable()
        self._reap()
        buf = self._buffer(handle.entry)
        out = torch.empty(0, dtype=handle.dtype, device=buf.device)
        return out.set_(buf.untyped_storage(), handle.offset, handle.size, handle.stride)

    def _buffer(self, entry):
        """A uint8 tensor over the entry's whole storage, ready for the current stream to read."""
        group = entry.group
        if group.state == _OPEN:
            group.state = _KEPT  # backward reached the layer still open: it stays on the device
        if entry.slot is None:
            return entry.src  # never copied out
        if entry.buf is None:
            self._load(group)
        if entry.h2d_event is not None:
            self._streams.wait_event(self._streams.current(), entry.h2d_event)
        return entry.buf

    def _load(self, group):
        """Loads `group` and up to `prefetch` offloaded groups before it, nearest first."""
        earlier = [g for i, g in self._groups.items() if i < group.index and g.state == _OFFLOADED and len(g.entries)]
        for g in [group] + earlier[::-1][:self.prefetch]:
            if not g.loaded:
                self._load_group(g)

    def _load_group(self, group):
        group.loaded = True
        entries = [e for e in group.live() if e.slot is not None and e.buf is None]
        if not entries:
            return
        s = self._streams
        # Allocated on the compute stream, so freeing them later needs no record_stream; the copies wait for that
        # stream's earlier work, which may still use the memory the allocator handed out.
        bufs = [s.empty_device(e.nbytes, self._device) for e in entries]
        s.wait_stream(self._h2d, s.current())
        out_in_flight = {id(e.d2h_event): e.d2h_event for e in entries if e.d2h_event is not None}
        for event in out_in_flight.values():
            s.wait_event(self._h2d, event)
        for e, buf in zip(entries, bufs):
            s.copy(buf, e.slot.tensor, self._h2d)
            e.buf = buf
        event = s.record(self._h2d)
        for e in entries:
            e.h2d_event = event
        self._h2d_bytes += sum(e.nbytes for e in entries)
        self._pending.append(_Copies(event, bufs, [e.slot for e in entries], entries, _copied_in))

    # --- copies out and reaping

    def _offload(self, group):
        group.state = _OFFLOADED
        entries = [e for e in group.live() if e.src is not None and e.nbytes and e.slot is None]
        if not entries:
            return
        s = self._streams
        slots = [self._arena.slot(e.nbytes) for e in entries]
        s.wait_stream(self._d2h, s.current())  # the layer's forward has written what it saved
        for e, slot in zip(entries, slots):
            s.copy(slot.tensor, e.src, self._d2h)
            e.slot = slot
        event = s.record(self._d2h)
        for e in entries:
            e.d2h_event = event
        self._d2h_bytes += sum(e.nbytes for e in entries)
        self._pending.append(_Copies(event, [e.src for e in entries], slots, entries, _copied_out))

    def _reap(self):
        """Drops what completed copies held; never blocks."""
        if not self._pending:
            return
        running = []
        for copies in self._pending:
            if self._streams.query(copies.event):
                copies.done()
            else:
                running.append(copies)
        self._pending[:] = running  # in place: the finalizer holds this list

    def synchronize(self):
        """Waits for every copy in flight and drops what they held."""
        self._check_usable()
        for copies in list(self._pending):
            self._streams.synchronize(copies.event)
        self._reap()
        self._prune()

    # --- bookkeeping

    def stats(self):
        """Host bytes held now (host_bytes_live), at most (host_peak) and allocated (host_capacity; host_allocations
        counts the host buffers allocated so far), bytes copied out and in, copies in flight (pending), groups
        holding entries, and the device bytes the engine holds (sources not yet copied out, reloaded buffers)."""
        arena = self._arena
        held = {}
        for group in self._groups.values():
            for e in group.live():
                for t in (e.src, e.buf):
                    if t is not None:
                        held[id(t)] = t.numel()
        for copies in self._pending:
            for t in copies.tensors:
                held[id(t)] = t.numel()
        return {"host_bytes_live": arena.live_bytes, "host_capacity": arena.capacity, "host_peak": arena.peak,
                "host_allocations": arena.allocations, "d2h_bytes": self._d2h_bytes, "h2d_bytes": self._h2d_bytes,
                "pending": sum(len(c.tensors) for c in self._pending),
                "groups": sum(1 for g in self._groups.values() if len(g.entries)), "device_bytes": sum(held.values())}

    def close(self):
        """Waits for the copies in flight and releases the arena; the engine cannot be used afterwards."""
        if self._closed:
            return
        if self._finalizer is not None:
            self._finalizer()
        else:
            self._arena.close()
        self._closed = True

    def _check_usable(self):
        if self._closed:
            raise RuntimeError("this offload engine was closed")

    def _bind(self, t):
        self._device = t.device
        if self._streams is None:
            real_cuda = t.device.type == "cuda" and not is_fake(t)
            self._start(CudaStreams(t.device) if real_cuda else SynchronousStreams())

    def _start(self, streams):
        self._streams = streams
        self._d2h, self._h2d = streams.new_stream("d2h"), streams.new_stream("h2d")  # never the same stream
        self._arena.start(streams)
        self._finalizer = weakref.finalize(self, _shut_down, streams, self._pending, self._arena)
        self._finalizer.atexit = False  # at exit the CUDA context may be gone; the process frees everything

    def _new_group(self):
        group = self._groups[self._next] = _Group(self._next)
        self._next += 1
        return group

    def _prune(self):
        for index in [i for i, g in self._groups.items() if g is not self._open and not len(g.entries)]:
            del self._groups[index]
