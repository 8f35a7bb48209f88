"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU).

For recompute "selective" and "full", and the same with what they keep offloaded (every kept class under
"selective", the layer inputs under "full"), a stack of SelectiveDecoderLayers with dropout on, and a tiny
Hugging Face Llama converted by selective_ckpt.convert (attention dropout on), are trained one step under DDP
and under FSDP2 (fully_shard per decoder layer). Every rank also computes, in one
process, the gradients averaged over both ranks' shards with the same per-rank seeds; the wrapped
model's gradients must equal them.
"""

import functools
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from selective_ckpt import SelectiveDecoderLayer, convert, keeping, set_recompute

E, H, S, PER_RANK = 32, 2, 6, 2
VOCAB = 53


MODES = {"selective": "selective", "full": "full",
         "selective offloaded": keeping.policy("selective", offload=["input", "qkv", "attention", "residual", "mlp"]),
         "full offloaded": keeping.policy("full", offload=["input"])}


def build(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[SelectiveDecoderLayer(E, H, dropout=0.15, attn_dropout=0.15) for _ in range(2)])
    set_recompute(model, MODES[mode])  # one offload engine for the stack when the policy offloads
    return model


def build_llama(mode):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=56, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.15)
    return convert(LlamaForCausalLM(config).train(), recompute=MODES[mode])


def llama_step(model, ids, dy, rank):
    torch.manual_seed(100 + rank)  # each rank's attention dropout seeds
    (model(input_ids=ids).logits * dy).sum().backward()


def step(model, x, dy, rank):
    torch.manual_seed(100 + rank)  # each rank's dropout seeds
    (model(x) * dy).sum().backward()


def reference_grads(model, run, xs, dys, world):
    for r in range(world):
        run(model, xs[r], dys[r], r)
    return {n: p.grad / world for n, p in model.named_parameters()}


def check_wrapped(name, build_model, layers_of, run, xs, dys, rank, world):
    """One step under DDP and under FSDP2 (per decoder layer, then the root) against one process."""
    ref = reference_grads(build_model(), run, xs, dys, world)
    ddp = DistributedDataParallel(build_model())
    run(ddp, xs[rank], dys[rank], rank)
    check(f"DDP/{name}", ddp, ref)
    model = build_model()
    for layer in layers_of(model):
        fully_shard(layer)
    fully_shard(model)
    run(model, xs[rank], dys[rank], rank)
    check(f"FSDP2/{name}", model, ref)


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
    ids = torch.randint(0, VOCAB, (world, PER_RANK, S), generator=g)
    dlogits = torch.randn(world, PER_RANK, S, VOCAB, generator=g)
    for mode in MODES:
        check_wrapped(mode, functools.partial(build, mode), list, step, xs, dys, rank, world)
        check_wrapped(f"llama/{mode}", functools.partial(build_llama, mode), lambda m: m.model.layers, llama_step, ids,
                      dlogits, rank, world)
        if rank == 0:
            print(f"ok {mode}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # Every check has passed and both ranks met at the barrier. Leave without tearing gloo down: its
    # teardown (process group and interpreter exit) has now and then aborted a rank with
    # std::terminate after all of the above, turning a passed run into a failed one.
    sys.stdout.flush()
    os._exit(0)
