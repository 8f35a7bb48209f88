"""Fused attention (selective_ckpt.attention) against eager attention with a materialised softmax
and torch.nn.functional.scaled_dot_product_attention: forward, backward and forward+backward time,
peak memory and what a forward leaves alive for backward, same inputs, same run, ratios printed.

q, k, v are views of one packed qkv projection [B, S, 3, H, D], as a decoder layer makes them.
CPU memory comes from the profiler's allocation events (every allocation, inside custom ops too);
CUDA memory from the caching allocator's counters. On CUDA TFLOP/s use 4*B*H*Sq*Sk*D for the
forward (halved when causal) and 2.5 times that for the backward.

    python -m selective_ckpt.bench.attention --batch 2 --heads 8 --seq 512 --dim 64

`--table` runs the CPU comparison instead: our fwd+bwd and our forward alone against SDPA's,
interleaved round by round in one process (B=2 H=8, causal; `--seqs`, `--dims`, `--dtypes` and
`--full` (also unmasked) choose the grid, default S 1024-4096, D 64, fp32/bf16/fp16), medians with
p20/p80, then 16 packed documents of 256 (cu_seqlens) against one document of 4096 through our kernel.
`--tiles 128x64,64x64` also sweeps the C++ kernel's query x key tile sizes.

`--backends` times the kernels selective_ckpt.attention can dispatch to on this device, each forced through the op
(set_attention_backend): ours against PyTorch's (on CPU its flash kernel), fwd+bwd interleaved round by round on the
same grid (`--seqs`, `--dims`, `--dtypes`, `--full`; `--gqa 4` gives k, v a quarter of the heads), and names the
kernel "auto" runs for each row, timed as the default setting runs it: the measurement the CPU default follows
(ops/attention_dispatch.py, CPU_FLASH_BELOW).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import selective_ckpt
from selective_ckpt import backend, memory
from selective_ckpt.bench.output import cpu_name
from selective_ckpt.bench.runner import sync
from selective_ckpt.ops import attention_dispatch

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


def quantiles(xs):
    """(p20, median, p80) of a sample."""
    xs = sorted(xs)
    at = lambda f: xs[min(len(xs) - 1, max(0, round(f * (len(xs) - 1))))]
    return at(0.2), statistics.median(xs), at(0.8)


def fwd_bwd_seconds(fn, qkv, grad, tiles=None):
    """Seconds of one forward+backward; `tiles` (query, key) holds for the C++ kernels meanwhile."""
    old = backend._C.attention_tiles(*tiles) if tiles else None
    try:
        qkv.grad = None
        t0 = time.perf_counter()
        fn(*views(qkv)).backward(grad)
        return time.perf_counter() - t0
    finally:
        if old:
            backend._C.attention_tiles(*old)


def interleaved(fns, qkv, grad, rounds, warmup=1):
    """Seconds per round for each fn, run alternately (order flipped every round) so load drifts on
    a shared machine hit all of them alike; per-round time ratios of each fn to the first.
    fns: name -> (fn, tiles or None)."""
    times = {n: [] for n in fns}
    for r in range(warmup + rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        got = {n: fwd_bwd_seconds(*fns[n][:1], qkv, grad, fns[n][1]) for n in order}
        if r >= warmup:
            for n in fns:
                times[n].append(got[n])
    first = next(iter(fns))
    ratios = {n: [a / b for a, b in zip(times[n], times[first])] for n in fns}
    return times, ratios


def packed(q, k, v, cu_seqlens):
    return selective_ckpt.attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)


def fmt(q3, scale=1e3):
    lo, med, hi = q3
    return f"{med * scale:9.1f} [{lo * scale:.1f}, {hi * scale:.1f}]"


def fwd_seconds(fn, q, k, v):
    """Seconds of one forward without autograd (what inference and a recomputing forward pay)."""
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(q, k, v)
        return time.perf_counter() - t0


def interleaved_fwd(fns, q, k, v, rounds, warmup=1):
    """Like interleaved, forward alone: per-round ratios of each fn to the first."""
    times = {n: [] for n in fns}
    for r in range(warmup + rounds):
        for n in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            t = fwd_seconds(fns[n], q, k, v)
            if r >= warmup:
                times[n].append(t)
    first = next(iter(fns))
    return {n: [a / b for a, b in zip(times[n], times[first])] for n in fns}


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def run_table(args):
    B, H = 2, 8
    seqs, dims, dtypes = _ints(args.seqs), _ints(args.dims), [d.strip() for d in args.dtypes.split(",") if d.strip()]
    masks = [True] + ([False] if args.full else [])
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")] if args.tiles else []
    default_tiles = backend._C.attention_tiles(64, 64)
    backend._C.attention_tiles(*default_tiles)
    print(f"CPU: {cpu_name()}")
    print(f"CPU attention against SDPA, B={B} H={H}, {args.rounds} interleaved rounds (torch threads "
          f"{torch.get_num_threads()}, kernel ISA {backend._C.attention_isa()}, tiles {default_tiles[0]}x"
          f"{default_tiles[1]}); ms median [p20, p80], ratio = ours / SDPA per round")
    print(f"{'S':>6} {'D':>4} {'mask':>6} {'dtype':>5} {'SDPA fwd+bwd ms':>26} {'ours fwd+bwd ms':>26} "
          f"{'fwd+bwd ratio':>22} {'forward ratio':>22}")
    for causal in masks:
        for D in dims:
            for dt in dtypes:
                for S in seqs:
                    qkv = torch.randn(B, S, 3, H, D, dtype=DTYPES[dt], requires_grad=True)
                    grad = torch.randn(B, H, S, D, dtype=DTYPES[dt])
                    mine = lambda q, k, v, causal=causal: ours(q, k, v, causal, 0.0)
                    theirs = lambda q, k, v, causal=causal: sdpa(q, k, v, causal, 0.0)
                    fns = {"sdpa": (theirs, None), "ours": (mine, None)}
                    fns.update({f"ours {bq}x{bk}": (mine, (bq, bk)) for bq, bk in tiles})
                    rounds = args.rounds if S < 4096 else max(3, args.rounds // 2)
                    times, ratios = interleaved(fns, qkv, grad, rounds)
                    fwd = interleaved_fwd({"sdpa": theirs, "ours": mine}, *views(qkv), rounds)["ours"]
                    for n in fns:
                        if n == "sdpa":
                            continue
                        r = quantiles(ratios[n])
                        f = quantiles(fwd) if n == "ours" else None
                        label = "" if n == "ours" else f"  ({n})"
                        fcol = f"{f[1]:>8.3f} [{f[0]:.3f}, {f[2]:.3f}]" if f else ""
                        print(f"{S:>6} {D:>4} {'causal' if causal else 'none':>6} {dt:>5} "
                              f"{fmt(quantiles(times['sdpa'])):>26} {fmt(quantiles(times[n])):>26} "
                              f"{r[1]:>8.3f} [{r[0]:.3f}, {r[2]:.3f}] {fcol:>22}{label}", flush=True)
    if not args.packed:
        return

    S, D, docs = 4096, 64, 16
    q, k, v = (torch.randn(1, H, S, D, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, H, S, D)
    cu = torch.arange(0, S + 1, S // docs, dtype=torch.int32)
    one = torch.tensor([0, S], dtype=torch.int32)
    fns = {"one": lambda: packed(q, k, v, one).backward(grad), "packed": lambda: packed(q, k, v, cu).backward(grad)}
    times = {n: [] for n in fns}
    for r in range(1 + args.rounds):
        for n in (fns if r % 2 == 0 else reversed(list(fns))):
            q.grad = k.grad = v.grad = None
            t0 = time.perf_counter()
            fns[n]()
            if r:
                times[n].append(time.perf_counter() - t0)
    ratio = quantiles([a / b for a, b in zip(times["packed"], times["one"])])
    peaks = {}
    for n, fn in fns.items():
        q.grad = k.grad = v.grad = None
        peaks[n] = memory.cpu_peak_bytes(fn)
    mib = 1 << 20
    print(f"\npacked documents, ours, causal fp32 H={H} D={D}: {docs} x {S // docs} (cu_seqlens) vs 1 x {S}")
    print(f"  fwd+bwd ms: packed {fmt(quantiles(times['packed']))}, one document {fmt(quantiles(times['one']))}; "
          f"ratio {ratio[1]:.3f} [{ratio[0]:.3f}, {ratio[2]:.3f}] (sum of len^2 ratio {1 / docs:.3f})")
    print(f"  peak MiB (torch allocations; the kernel's own per-thread tiles are not seen): packed "
          f"{peaks['packed'] / mib:.2f}, one document {peaks['one'] / mib:.2f}")


def run_backends(args):
    """ours against PyTorch's kernel through the op, per grid row; the kernel "auto" picks named."""
    B, H = 2, 8
    Hkv = H // args.gqa
    seqs, dims, dtypes = _ints(args.seqs), _ints(args.dims), [d.strip() for d in args.dtypes.split(",") if d.strip()]
    masks = [True] + ([False] if args.full else [])
    setting = backend.attention_setting()
    print(f"CPU: {cpu_name()}")
    print(f"selective_ckpt.attention's kernels on CPU, forced: B={B} H={H} Hkv={Hkv}, {args.rounds} interleaved "
          f"rounds (torch threads {torch.get_num_threads()}); fwd+bwd ms median [p20, p80], ratio = PyTorch's / ours "
          f"per round (> 1: ours faster); auto = the kernel the default setting runs, timed as the default runs it "
          f"(the CPU flash kernel under its own autograd node where it runs it), auto / ours per round")
    print(f"{'S':>6} {'D':>4} {'mask':>6} {'dtype':>5} {'ours ms':>26} {'sdpa_cpu_flash ms':>26} "
          f"{'ratio':>22} {'auto':>15} {'auto ms':>26} {'auto / ours':>22}")

    def forced(name, causal):
        def fn(q, k, v):
            selective_ckpt.set_attention_backend(name)
            return selective_ckpt.attention(q, k, v, causal=causal)
        return fn

    try:
        for causal in masks:
            for D in dims:
                for dt in dtypes:
                    for S in seqs:
                        qkv = torch.randn(B, S, H + 2 * Hkv, D, dtype=DTYPES[dt], requires_grad=True)
                        grad = torch.randn(B, H, S, D, dtype=DTYPES[dt])
                        split = lambda t: [t[:, :, a:b].permute(0, 2, 1, 3)  # noqa: E731
                                           for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv))]
                        fns = {"ours": forced("ours", causal), "sdpa": forced("sdpa", causal),
                               "auto": forced("auto", causal)}
                        times = {n: [] for n in fns}
                        for r in range(1 + args.rounds):
                            for n in (list(fns) if r % 2 == 0 else list(reversed(fns))):
                                qkv.grad = None
                                t0 = time.perf_counter()
                                fns[n](*split(qkv)).backward(grad)
                                if r:
                                    times[n].append(time.perf_counter() - t0)
                        ratio = quantiles([a / b for a, b in zip(times["sdpa"], times["ours"])])
                        vs = quantiles([a / b for a, b in zip(times["auto"], times["ours"])])
                        selective_ckpt.set_attention_backend("auto")
                        auto = attention_dispatch.choose_for(*split(qkv)[:2], None, None, causal, 0, 0.0, 0.0, 0)
                        print(f"{S:>6} {D:>4} {'causal' if causal else 'none':>6} {dt:>5} "
                              f"{fmt(quantiles(times['ours'])):>26} {fmt(quantiles(times['sdpa'])):>26} "
                              f"{ratio[1]:>8.3f} [{ratio[0]:.3f}, {ratio[2]:.3f}] {auto:>15} "
                              f"{fmt(quantiles(times['auto'])):>26} {vs[1]:>8.3f} [{vs[0]:.3f}, {vs[2]:.3f}]",
                              flush=True)
    finally:
        selective_ckpt.set_attention_backend(setting)


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
    ap.add_argument("--table", action="store_true", help="the CPU comparison table against SDPA (see above)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per --table row")
    ap.add_argument("--tiles", default="", help="--table: also time these C++ tile sizes, e.g. 128x64,64x64")
    ap.add_argument("--seqs", default="1024,2048,4096", help="--table: sequence lengths")
    ap.add_argument("--dims", default="64", help="--table: head dims, e.g. 64,128")
    ap.add_argument("--dtypes", default="fp32,bf16,fp16", help="--table: dtypes")
    ap.add_argument("--full", action="store_true", help="--table: also without a causal mask")
    ap.add_argument("--backends", action="store_true",
                    help="the op's kernels forced one by one, ours against PyTorch's (see above)")
    ap.add_argument("--gqa", type=int, default=1, help="--backends: H / Hkv")
    ap.add_argument("--no-packed", dest="packed", action="store_false",
                    help="--table: skip the packed-documents comparison")
    args = ap.parse_args(argv)
    if args.table:
        return run_table(args)
    if args.backends:
        return run_backends(args)
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
