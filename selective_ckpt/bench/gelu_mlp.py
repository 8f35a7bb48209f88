"""GELU-MLP training step: selective (recompute GELU and the mask) vs store mode vs eager.

Eager is nn.Sequential(Linear, GELU, Linear, Dropout) with the same weights. One step is forward +
backward with a fixed output gradient. Reports the min and median step time and the peak bytes the step
allocates on top of inputs and parameters, with ratios against eager and against store mode.

Peak memory: on CUDA the caching allocator's peak; on CPU selective_ckpt.memory.cpu_peak_bytes,
the running sum of the profiler's allocation events (buffers inside custom ops included).

    python -m selective_ckpt.bench.gelu_mlp --tokens 2048 --d-in 512 --hidden 2048
"""

import argparse
import statistics
import time

import torch
from torch import nn

from selective_ckpt import gelu_mlp, memory
from selective_ckpt.bench.runner import sync


def make_eager(d_in, hidden, p, approximate, dtype, device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(approximate=approximate), nn.Linear(hidden, d_in),
                         nn.Dropout(p)).to(device=device, dtype=dtype)


def step_fn(kind, model, x, dy, p, approximate):
    fc1, fc2 = model[0], model[2]

    def step():
        for prm in model.parameters():
            prm.grad = None
        x.grad = None
        if kind == "eager":
            y = model(x)
        else:
            y = gelu_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, p, approximate, seed=1234,
                         store_activation=kind == "store")
        y.backward(dy)

    return step


def time_steps(steps, device, repeats, warmup=2):
    """(min, median) seconds per step of each variant, interleaved so drift hits all alike. The
    min is the least disturbed run, the figure to compare on a shared machine."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync(device)
    times = {kind: [] for kind in steps}
    for _ in range(repeats):
        for kind, step in steps.items():
            start = time.perf_counter()
            step()
            sync(device)
            times[kind].append(time.perf_counter() - start)
    return {kind: (min(t), statistics.median(t)) for kind, t in times.items()}


def peak_bytes(step, device, model, x):
    step()  # warm up lazy state so it is not counted
    for t in (*model.parameters(), x):  # so the step allocates its gradients afresh
        t.grad = None
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    return memory.cpu_peak_bytes(step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-in", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--approximate", choices=["none", "tanh"], default="none")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = make_eager(args.d_in, args.hidden, args.dropout, args.approximate, dtype, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.tokens, args.d_in, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    dy = torch.randn(args.tokens, args.d_in, generator=g).to(device=device, dtype=dtype)

    print(f"GELU-MLP step, tokens={args.tokens} in={args.d_in} hidden={args.hidden} p={args.dropout} "
          f"gelu={args.approximate} {args.dtype} on {device} ({torch.get_num_threads()} threads)")
    steps = {kind: step_fn(kind, model, x, dy, args.dropout, args.approximate)
             for kind in ("eager", "store", "selective")}
    times = time_steps(steps, device, args.repeats)
    results = {kind: (times[kind], peak_bytes(step, device, model, x))
               for kind, step in steps.items()}
    (t_e, med_e), m_e = results["eager"]
    (t_s, med_s), m_s = results["store"]
    for kind, ((t, med), m) in results.items():
        print(f"  {kind:9s} step min {t * 1e3:8.2f} ms (median {med * 1e3:8.2f})  peak {m / 2**20:7.2f} MiB  "
              f"time/eager {t / t_e:5.3f} (median {med / med_e:5.3f})  time/store {t / t_s:5.3f}  "
              f"peak/eager {m / m_e:5.3f}  peak/store {m / m_s:5.3f}")

if __name__ == "__main__":
    main()
