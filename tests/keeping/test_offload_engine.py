"""The offload engine (keeping.offload) against plain autograd, on CPU tensors with SimulatedStreams.

SimulatedStreams runs side-stream copies late and poisons what a missing wait or an early free lets through
(keeping.streams), so ordering mistakes that would race on a GPU give NaN here. The reference is the same chain
run without hooks; gradients must be bit-identical.
"""

import contextlib
import gc
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from selective_ckpt.keeping.offload import ALIGN, OffloadEngine, OffloadHandle
from selective_ckpt.keeping.streams import SimulatedStreams, SynchronousStreams

N, D, LAYERS = 8, 8, 4


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors are tiny: threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _layer(h, w):
    qkv = h @ w  # one buffer
    q, k, v = qkv.split(D, dim=1)  # views of it at offsets 0, D, 2D
    s = torch.sin(q) * k  # saves q's and k's views of one storage
    m = v[1:].t() @ s[1:]  # saves a transposed slice with an offset, and a slice
    return h + torch.tanh(s * v) + torch.sin(h @ m)  # h is saved by two nodes


class Chain:
    """LAYERS small layers; `groups` records, per layer, the non-leaf tensors its forward saved."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ws = [(torch.randn(D, 3 * D, generator=g) * 0.3).requires_grad_() for _ in range(LAYERS)]
        self.xs = [torch.randn(N, D, generator=g).requires_grad_() for _ in range(2)]
        self.groups = []

    def params(self):
        return [*self.xs, *self.ws]

    def zero(self):
        for p in self.params():
            p.grad = None

    def grads(self):
        return [None if p.grad is None else p.grad.clone() for p in self.params()]

    def forward(self, engine=None, which=0, fail_at=None):
        with _hooks(engine, self.groups) if engine is not None else contextlib.nullcontext():
            h = self.xs[which]
            for i, w in enumerate(self.ws):
                if engine is not None:
                    engine.begin_layer()
                self.groups.append([])
                if i == fail_at:
                    torch.sin(h)
                    raise ValueError("a layer failed")
                h = _layer(h, w)
        return h.sum()


@contextlib.contextmanager
def _hooks(engine, groups):
    def pack(t):
        if t.is_leaf:
            return t  # inputs and weights stay where they are
        groups[-1].append(t)
        return engine.offload(t)

    def unpack(h):
        return h.get() if isinstance(h, OffloadHandle) else h

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _unique_storages(tensors):
    seen = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return list(seen.values())


def _storage_bytes(groups):
    return sum(sum(_unique_storages(g)) for g in groups)


def _reference(steps):
    """Gradients of `steps` (a list of actions on a fresh Chain without an engine)."""
    chain = Chain()
    steps(chain, None)
    return chain.grads()


def _assert_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert not a.isnan().any()
            assert torch.equal(a, b)


def _one_step(chain, engine):
    chain.forward(engine).backward()


def _assert_empty(engine, sim=None):
    gc.collect()
    engine.synchronize()
    stats = engine.stats()
    assert stats["host_bytes_live"] == 0 and stats["pending"] == 0
    assert stats["groups"] == 0 and stats["device_bytes"] == 0
    if sim is not None:
        assert sim.queued() == 0


def _assert_ordered(sim):
    """Every batch of copies on a side stream starts by waiting for the compute stream."""
    for name in ("d2h", "h2d"):
        ops = [op for op in sim.log if op[1] == name]
        batch_start = True
        for kind, _, other in ops:
            if batch_start and kind == "copy":
                pytest.fail(f"a {name} copy was issued before {name} waited for the compute stream")
            if kind == "wait" and other == "compute":
                batch_start = False
            if kind == "record":
                batch_start = True


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gradients_bit_identical_and_last_group_kept(prefetch):
    want = _reference(_one_step)
    chain, sim = Chain(), SimulatedStreams()
    engine = OffloadEngine(prefetch=prefetch, streams=sim)
    loss = chain.forward(engine)
    offloaded = _storage_bytes(chain.groups[:-1])
    engine.synchronize()
    # the copies out have completed: only the last group's storages are still held on the device
    assert engine.stats()["device_bytes"] == _storage_bytes(chain.groups[-1:])
    loss.backward()
    _assert_equal(chain.grads(), want)
    stats = engine.stats()
    assert stats["d2h_bytes"] == offloaded == sim.bytes["d2h"]
    assert stats["h2d_bytes"] == offloaded == sim.bytes["h2d"]
    assert sim.dead_sources == sim.dead_destinations == 0
    _assert_ordered(sim)
    del loss
    _assert_empty(engine, sim)


def test_default_streams_on_cpu():
    want = _reference(_one_step)
    chain = Chain()
    engine = OffloadEngine()
    _one_step(chain, engine)
    _assert_equal(chain.grads(), want)
    assert isinstance(engine._streams, SynchronousStreams)
    assert engine.stats()["d2h_bytes"] == _storage_bytes(chain.groups[:-1])
    _assert_empty(engine)


def _saved_views():
    """Views of a few storages, as layers save them."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 3 * D, generator=g)
    a = torch.randn(7, 9, generator=g, dtype=torch.float64)
    b = torch.randn(5, 4, generator=g).to(torch.bfloat16)
    k, v = qkv[:, D:2 * D], qkv[:, 2 * D:]
    return [k, v, a[1:, 2:].t(), a[3], b, b, qkv.view(torch.int32)[2:, ::3]]


def test_views_come_back_exactly():
    sim = SimulatedStreams(delay=3)
    engine = OffloadEngine(streams=sim)
    views = _saved_views()
    copies = [t.clone() for t in views]
    storage_bytes = [t.untyped_storage().nbytes() for t in views]
    geometry = [(t.dtype, t.size(), t.stride(), t.storage_offset()) for t in views]
    engine.begin_layer()
    handles = [engine.offload(t) for t in views]
    engine.begin_layer()
    engine.offload(torch.ones(3) * 2)  # the open group
    sizes = _unique_storages(views)
    assert engine.stats()["d2h_bytes"] == sum(sizes) and sim.copies["d2h"] == len(sizes)  # one copy per storage
    engine.synchronize()
    del views
    gc.collect()
    for h, want, shape in zip(handles, copies, geometry):
        for _ in range(2):  # a handle may be read more than once
            got = h.get()
            assert (got.dtype, got.size(), got.stride(), got.storage_offset()) == shape
            assert torch.equal(got, want)
    got = [h.get() for h in handles]
    assert [t.untyped_storage().nbytes() for t in got] == storage_bytes  # each a view of its whole storage
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()  # k and v: one reload
    assert engine.stats()["h2d_bytes"] == sum(sizes)
    assert sim.dead_sources == sim.dead_destinations == 0


def test_open_group_is_not_copied_and_dead_groups_are_skipped():
    sim = SimulatedStreams()
    engine = OffloadEngine(streams=sim)
    engine.begin_layer()
    engine.offload(torch.randn(100))  # its handle dies at once: nothing to copy
    engine.begin_layer()
    t = torch.randn(4, 5)
    h = engine.offload(t[1:])
    assert h.get().untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # the source itself
    engine.begin_layer()
    assert engine.stats()["d2h_bytes"] == 0 and sim.copies["d2h"] == 0


def test_tensors_without_a_plain_storage_are_kept_and_one_device_is_served():
    engine = OffloadEngine(streams=SimulatedStreams())
    engine.begin_layer()
    sparse = torch.randn(4).to_sparse()
    assert torch.equal(engine.offload(sparse).get().to_dense(), sparse.to_dense())
    engine.offload(torch.randn(3))
    with pytest.raises(RuntimeError, match="cpu"):
        engine.offload(torch.empty(3, device="meta"))


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_prefetch_loads_earlier_groups(prefetch):
    engine = OffloadEngine(prefetch=prefetch, streams=SimulatedStreams())
    sizes = [4, 16, 64, 256]  # float32 elements; each group's bytes tell which groups were loaded
    tensors, handles = [], []
    for n in sizes:
        engine.begin_layer()
        tensors.append(torch.randn(n))
        handles.append(engine.offload(tensors[-1]))
    engine.begin_layer()  # the last of them is now copied out too
    assert engine.stats()["d2h_bytes"] == 4 * sum(sizes)
    assert torch.equal(handles[3].get(), tensors[3])
    loaded = sizes[max(0, 3 - prefetch):]
    assert engine.stats()["h2d_bytes"] == 4 * sum(loaded)
    for i in (2, 1, 0):
        assert torch.equal(handles[i].get(), tensors[i])
    assert engine.stats()["h2d_bytes"] == 4 * sum(sizes)  # each group loaded once


def _broken_query(sim, engine):
    sim.query = lambda event: True  # reaping believes every copy done: sources are dropped too early


def _no_wait_in_get(sim, engine):
    wait_event = sim.wait_event
    sim.wait_event = lambda stream, event: None if stream is sim.compute else wait_event(stream, event)


@pytest.mark.parametrize("breakage", [None, _broken_query, _no_wait_in_get])
def test_poison_catches_missing_waits(breakage):
    want = _reference(_one_step)
    chain, sim = Chain(), SimulatedStreams()
    engine = OffloadEngine(streams=sim)
    if breakage is not None:
        breakage(sim, engine)
    _one_step(chain, engine)
    got = chain.grads()
    if breakage is None:
        _assert_equal(got, want)
    else:
        assert any(g.isnan().any() for g in got)


@pytest.mark.parametrize("ignore_side_waits", [False, True])
def test_reload_waits_for_a_copy_out_in_flight(ignore_side_waits):
    sim = SimulatedStreams(delay=1000)  # the copy out is still queued when backward reads the group
    if ignore_side_waits:
        wait_event = sim.wait_event
        sim.wait_event = lambda stream, event: wait_event(stream, event) if stream is sim.compute else None
    engine = OffloadEngine(streams=sim)
    t = torch.randn(33)
    engine.begin_layer()
    h = engine.offload(t)
    engine.begin_layer()
    got = h.get()
    assert torch.equal(got, t) != ignore_side_waits
    assert got.isnan().all().item() == ignore_side_waits


def test_forward_without_backward_leaves_nothing():
    chain, sim = Chain(), SimulatedStreams()
    engine = OffloadEngine(streams=sim)

    def forwards(n):
        for _ in range(n):
            loss = chain.forward(engine)
            del loss
            chain.groups.clear()  # the saved tensors' own nodes would keep the graph alive

    forwards(3)
    _assert_empty(engine, sim)
    gc.collect()
    tensors = sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())
    allocations, blocking = engine.stats()["host_allocations"], sim.blocking
    compute_waits = sum(op[0] == "wait" and op[1] == "compute" for op in sim.log)
    forwards(100)
    assert sim.blocking == blocking  # nothing waited on a stream
    assert sum(op[0] == "wait" and op[1] == "compute" for op in sim.log) == compute_waits
    chain.groups.clear()
    _assert_empty(engine, sim)
    assert engine.stats()["host_allocations"] == allocations  # the arena is reused, not grown
    assert engine.stats()["d2h_bytes"] > 0 and engine.stats()["h2d_bytes"] == 0
    gc.collect()
    assert sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects()) <= tensors


def _accumulate_together(chain, engine):
    first, second = chain.forward(engine, 0), chain.forward(engine, 1)
    first.backward()
    second.backward()


def _accumulate_in_turn(chain, engine):
    chain.forward(engine, 0).backward()
    chain.forward(engine, 1).backward()


def _retain_graph(chain, engine):
    loss = chain.forward(engine)
    loss.backward(retain_graph=True)
    loss.backward()


@pytest.mark.parametrize("steps", [_accumulate_together, _accumulate_in_turn, _retain_graph])
def test_accumulation_and_retained_graphs(steps):
    want = _reference(steps)
    chain, sim = Chain(), SimulatedStreams()
    engine = OffloadEngine(streams=sim)
    steps(chain, engine)
    _assert_equal(chain.grads(), want)
    stats = engine.stats()
    assert stats["h2d_bytes"] == stats["d2h_bytes"] > 0  # a second backward reads the loaded buffers again
    assert sim.dead_sources == sim.dead_destinations == 0
    _assert_empty(engine, sim)


def test_exception_mid_forward():
    chain, sim = Chain(), SimulatedStreams()
    engine = OffloadEngine(streams=sim)
    try:
        chain.forward(engine, fail_at=2)
    except ValueError:
        pass
    chain.groups.clear()
    _assert_empty(engine, sim)
    assert engine.stats()["d2h_bytes"] > 0
    want = _reference(_one_step)
    _one_step(chain, engine)
    _assert_equal(chain.grads(), want)


def _arena_need(groups):
    """Where the bump pointer ends for these groups' storages: 512-byte aligned starts, no rounding at the end."""
    top = 0
    for group in groups:
        for n in _unique_storages(group):
            top = -(-top // ALIGN) * ALIGN + n
    return top


def test_arena_exact_size_and_reuse():
    want = _reference(_one_step)
    chain, sim = Chain(), SimulatedStreams()
    engine = OffloadEngine(host_bytes=None, streams=sim)
    _one_step(chain, engine)
    need = _arena_need(chain.groups[:-1])
    assert need & (need - 1) and need % ALIGN  # neither a power of two nor a multiple of the alignment
    assert engine.stats()["host_capacity"] == 0  # the first step used a slot of its own per storage
    allocations = []
    for _ in range(3):
        chain.zero()
        chain.groups.clear()
        _one_step(chain, engine)
        _assert_equal(chain.grads(), want)
        stats = engine.stats()
        assert stats["host_capacity"] == need and stats["host_peak"] <= need
        allocations.append(stats["host_allocations"])
    assert allocations[0] == allocations[1] == allocations[2]  # one arena for every later step
    assert sim.pinned_bytes == need  # the first step's slots were unpinned as they died
    engine.close()
    assert sim.pinned_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.begin_layer()


def test_arena_sized_up_front():
    chain, sim = Chain(), SimulatedStreams()
    engine = OffloadEngine(host_bytes=65_536, streams=sim)
    assert engine.stats()["host_capacity"] == 65_536 and sim.pinned_bytes == 65_536
    for _ in range(2):
        chain.groups.clear()
        _one_step(chain, engine)
    assert engine.stats()["host_allocations"] == 1


def test_failing_pin_warns_once_and_goes_pageable():
    want = _reference(_one_step)
    chain, sim = Chain(), SimulatedStreams(pinnable=False)
    engine = OffloadEngine(streams=sim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            chain.zero()
            chain.groups.clear()
            _one_step(chain, engine)
            _assert_equal(chain.grads(), want)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "cudaHostRegister" in message and "pageable" in message and "strict" in message
    assert sim.pinned_bytes == 0


def test_failing_pin_with_strict_raises():
    with pytest.raises(RuntimeError, match="strict"):
        OffloadEngine(host_bytes=4096, strict=True, streams=SimulatedStreams(pinnable=False))
    chain = Chain()
    engine = OffloadEngine(strict=True, streams=SimulatedStreams(pinnable=False))
    with pytest.raises(RuntimeError, match="strict"):
        chain.forward(engine)


def test_no_pinning_when_pin_is_false():
    sim = SimulatedStreams()
    engine = OffloadEngine(host_bytes=4096, pin=False, streams=sim)
    assert engine.stats()["host_capacity"] == 4096 and sim.pinned_bytes == 0


@pytest.mark.parametrize("streams", ["simulated", None])
def test_fake_cuda_bookkeeping(streams):
    # With a torch built without CUDA, autograd cannot run on fake CUDA tensors (the process aborts while making
    # a gradient accumulator) and Python indexing of them raises: the pack and unpack calls are made directly,
    # as the hooks would make them, on views made with narrow, split and t.
    with FakeTensorMode():
        sim = SimulatedStreams() if streams else None
        engine = OffloadEngine(streams=sim)
        qkv = torch.empty(8, 3 * D, device="cuda")
        a = torch.empty(7, 9, device="cuda", dtype=torch.bfloat16)
        q, k, _ = qkv.split(D, dim=1)
        groups = [[q, k, qkv, a], [a.narrow(0, 1, 6).narrow(1, 2, 7).t(), torch.empty(5, device="cuda")],
                  [torch.empty(11, device="cuda")]]
        handles = []
        for group in groups:
            engine.begin_layer()
            handles += [engine.offload(t) for t in group]
        want = sum(sum(_fake_bytes(_fake_unique(g))) for g in groups[:2])
        assert want == (8 * 3 * D * 4 + 7 * 9 * 2) + (7 * 9 * 2 + 5 * 4)  # a's storage once in each group
        assert engine.stats()["d2h_bytes"] == want
        for h, t in zip(handles, [t for g in groups for t in g]):
            got = h.get()
            assert got.device.type == "cuda" and got.dtype == t.dtype and got.size() == t.size()
            assert got.stride() == t.stride() and got.storage_offset() == t.storage_offset()
        engine.synchronize()
        assert engine.stats()["h2d_bytes"] == want
        if sim is not None:
            assert sim.bytes["d2h"] == sim.bytes["h2d"] == want


def _fake_bytes(tensors):
    return [t.untyped_storage().nbytes() for t in tensors]


def test_fake_cpu_autograd_bookkeeping():
    with FakeTensorMode():
        chain = Chain()
        engine = OffloadEngine()
        _one_step(chain, engine)
        stats = engine.stats()
        assert stats["d2h_bytes"] == stats["h2d_bytes"] == sum(
            sum(_fake_bytes(_fake_unique(g))) for g in chain.groups[:-1])


def _fake_unique(tensors):
    """Fake tensors have no addresses: storages told apart by identity (kept alive by the list)."""
    seen = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage()._cdata, t)
    return list(seen.values())


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(prefetch=-1), ValueError, "prefetch"),
    (dict(prefetch=1.5), TypeError, "prefetch"),
    (dict(prefetch=True), TypeError, "prefetch"),
    (dict(host_bytes=-1), ValueError, "host_bytes"),
    (dict(host_bytes="8"), TypeError, "host_bytes"),
    (dict(pin="yes"), TypeError, "pin"),
    (dict(strict=1), TypeError, "strict"),
    (dict(streams=object()), TypeError, "streams"),
])
def test_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        OffloadEngine(**kwargs)


def test_bad_simulation_delay():
    with pytest.raises(ValueError, match="delay"):
        SimulatedStreams(delay=0)
