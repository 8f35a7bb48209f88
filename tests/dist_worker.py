"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU).

For recompute "selective" and "full", a stack of SelectiveDecoderLayers with dropout on is
trained one step under DDP and under FSDP2 (fully_shard per layer). Every rank also computes, in
one process, the gradients averaged over both ranks' shards with the same per-rank seeds; the
wrapped model's gradients must equal them.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from selective_ckpt import SelectiveDecoderLayer

E, H, S, PER_RANK = 32, 2, 6, 2


def build(mode):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[SelectiveDecoderLayer(E, H, dropout=0.15, attn_dropout=0.15, recompute=mode)
                                 for _ in range(2)])


def step(model, x, dy, rank):
    torch.manual_seed(100 + rank)  # each rank's dropout seeds
    (model(x) * dy).sum().backward()


def reference_grads(mode, xs, dys, world):
    model = build(mode)
    for r in range(world):
        step(model, xs[r], dys[r], r)
    return {n: p.grad / world for n, p in model.named_parameters()}


def check(name, model, ref):
    for n, p in model.named_parameters():
        n = n.replace("module.", "")
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if not torch.allclose(grad, ref[n], rtol=1e-5, atol=1e-6):
            raise AssertionError(f"{name}: gradient of {n} differs by {(grad - ref[n]).abs().max().item():.3e}")


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"worker {rank} started", flush=True)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(world, PER_RANK, S, E, generator=g)
    dys = torch.randn(world, PER_RANK, S, E, generator=g)
    for mode in ("selective", "full"):
        ref = reference_grads(mode, xs, dys, world)
        ddp = DistributedDataParallel(build(mode))
        step(ddp, xs[rank], dys[rank], rank)
        check(f"DDP/{mode}", ddp, ref)
        model = build(mode)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        step(model, xs[rank], dys[rank], rank)
        check(f"FSDP2/{mode}", model, ref)
        if rank == 0:
            print(f"ok {mode}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
