"""Fused attention (selective_ckpt.attention) against eager attention with a materialised softmax
and torch.nn.functional.scaled_dot_product_attention: forward, backward and forward+backward time,
peak memory and what a forward leaves alive for backward, same inputs, same run, ratios printed.

q, k, v are views of one packed qkv projection [B, S, 3, H, D], as a decoder layer makes them.
CPU memory comes from the profiler's allocation events (every allocation, inside custom ops too);
CUDA memory from the caching allocator's counters. On CUDA TFLOP/s use 4*B*H*Sq*Sk*D for the
forward (halved when causal) and 2.5 times that for the backward.

    python bench/attention.py --batch 2 --heads 8 --seq 512 --dim 64
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import selective_ckpt  # noqa: E402
from selective_ckpt import memory  # noqa: E402
from selective_ckpt.bench import sync  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def ours(q, k, v, causal, p):
    return selective_ckpt.attention(q, k, v, causal=causal, dropout_p=p)


def eager(q, k, v, causal, p):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        Sq, Sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    a = torch.softmax(s, dim=-1)
    if p > 0:
        a = F.dropout(a, p)
    return a @ v


def sdpa(q, k, v, causal, p):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)


IMPLS = {"selective_ckpt": ours, "eager": eager, "sdpa": sdpa}


def make_inputs(args, device):
    dtype = DTYPES[args.dtype]
    qkv = torch.randn(args.batch, args.seq, 3, args.heads, args.dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.batch, args.heads, args.seq, args.dim, device=device, dtype=dtype)
    return qkv, grad


def views(qkv):
    return [qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3)]


def time_impl(fn, qkv, grad, args, device):
    """Median seconds of forward, backward and forward+backward."""
    fwd, bwd, both = [], [], []
    for it in range(args.warmup + args.repeats):
        qkv.grad = None
        sync(device)
        t0 = time.perf_counter()
        o = fn(*views(qkv), args.causal, args.dropout)
        sync(device)
        t1 = time.perf_counter()
        o.backward(grad)
        sync(device)
        t2 = time.perf_counter()
        if it >= args.warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            both.append(t2 - t0)
        del o
    return [statistics.median(x) for x in (fwd, bwd, both)]


def memory_impl(fn, qkv, grad, args, device):
    """(peak bytes over forward+backward, bytes a forward leaves alive) above what existed before."""
    qkv.grad = None
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = fn(*views(qkv), args.causal, args.dropout)
        sync(device)
        kept = torch.cuda.memory_allocated() - base
        o.backward(grad)
        sync(device)
        peak = torch.cuda.max_memory_allocated() - base
        del o
        qkv.grad = None
        return peak, kept
    holder = {}
    trace = memory.cpu_allocation_deltas(lambda: holder.__setitem__("o", fn(*views(qkv), args.causal, args.dropout)))
    kept = sum(trace)
    trace += memory.cpu_allocation_deltas(lambda: holder.pop("o").backward(grad))
    peak = memory.running_peak(trace)
    qkv.grad = None
    return peak, kept


def flops(args):
    fwd = 4 * args.batch * args.heads * args.seq * args.seq * args.dim / (2 if args.causal else 1)
    return fwd, 2.5 * fwd, 3.5 * fwd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    names = [n.strip() for n in args.impls.split(",") if n.strip()]
    for n in names:
        if n not in IMPLS:
            ap.error(f"unknown impl {n!r}; choose from {', '.join(IMPLS)}")

    print(f"attention B={args.batch} H={args.heads} S={args.seq} D={args.dim} {args.dtype} causal={args.causal} "
          f"dropout={args.dropout} on {device} (torch threads {torch.get_num_threads()})")
    qkv, grad = make_inputs(args, device)
    results = {}
    for n in names:
        times = time_impl(IMPLS[n], qkv, grad, args, device)
        peak, kept = memory_impl(IMPLS[n], qkv, grad, args, device)
        results[n] = times + [peak, kept]

    mib = 1 << 20
    header = f"{'impl':<16}{'fwd ms':>10}{'bwd ms':>10}{'fwd+bwd ms':>12}{'peak MiB':>10}{'kept MiB':>10}"
    if device.type == "cuda":
        header += f"{'fwd TF/s':>10}{'bwd TF/s':>10}"
    print(header)
    for n, (f, b, fb, peak, kept) in results.items():
        line = f"{n:<16}{f * 1e3:>10.2f}{b * 1e3:>10.2f}{fb * 1e3:>12.2f}{peak / mib:>10.2f}{kept / mib:>10.2f}"
        if device.type == "cuda":
            ff, fbw, _ = flops(args)
            line += f"{ff / f / 1e12:>10.1f}{fbw / b / 1e12:>10.1f}"
        print(line)
    if "selective_ckpt" in results:
        mine = results["selective_ckpt"]
        for other in (n for n in results if n != "selective_ckpt"):
            ref = results[other]
            ratios = "  ".join(f"{label} {m / r:.2f}x" for label, m, r in
                               zip(("fwd", "bwd", "fwd+bwd", "peak", "kept"), mine, ref) if r > 0)
            print(f"selective_ckpt / {other}: {ratios}")


if __name__ == "__main__":
    main()
