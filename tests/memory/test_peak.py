"""memory.cpu_peak_bytes (allocator events) and memory.StorageTracker (live op outputs)."""


import pytest
import torch
from torch import nn

from selective_ckpt import memory

F32 = 4


# ---------------------------------------------------------------------------------------------
# Live-storage tracker


def test_storage_tracker_peak_and_release():
    tracker = memory.StorageTracker()
    with tracker:
        a = torch.ones(1000)  # 4000 B
        b = a + 1  # 8000 live
        v = b.view(10, 100)  # a view: no new storage
        b.add_(1)  # in place: no new storage
        del a  # 4000 live
        c = torch.zeros(500, dtype=torch.float64)  # +4000
        del c
    assert tracker.peak == 8000
    assert tracker.current == 4000
    del b, v
    assert tracker.current == 0


def test_storage_tracker_step_includes_grads():
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    tracker = memory.StorageTracker()
    with tracker:
        lin(x).sum().backward()
    grads = (64 * 64 + 64 + 32 * 64) * F32
    assert tracker.peak >= grads
    assert tracker.current == grads  # the grads stay; everything else was freed


@torch.library.custom_op("test_memory::with_scratch", mutates_args=())
def _with_scratch(x: torch.Tensor) -> torch.Tensor:
    scratch = torch.empty(4096, dtype=torch.float32)  # 16 KiB allocated and freed inside the op
    scratch.fill_(1.0)
    return x + scratch[: x.numel()].view_as(x)


def test_cpu_peak_bytes_counts_allocations_inside_ops():
    x = torch.ones(10)

    def fn():
        a = torch.ones(1000)  # 4000 B
        b = a + 1  # 8000 live
        del a
        c = torch.zeros(500, dtype=torch.float64)  # 8000 live again
        del b, c
        _with_scratch(x)  # 16384 scratch + 40 output inside the op

    assert memory.cpu_peak_bytes(fn) == 4096 * 4 + 40
    tracker = memory.StorageTracker()
    with tracker:
        fn()
    assert tracker.peak == 8000  # sees op outputs only: the custom op's scratch is invisible to it


def test_allocation_deltas_see_frees_of_blocks_an_earlier_measurement_allocated():
    """What the docstring says measurements must guard against: a block left alive by an earlier profiled
    window is seen when it dies in a later one; a block from outside any profiler is not."""
    outside = [torch.ones(300)]
    kept = []
    first = memory.cpu_allocation_deltas(lambda: kept.append(torch.ones(500)))
    if first is None:
        pytest.skip("the profiler's raw memory events are not available")
    assert first == [500 * F32]
    assert memory.cpu_allocation_deltas(kept.clear) == [-500 * F32]
    assert memory.cpu_allocation_deltas(outside.clear) == []
