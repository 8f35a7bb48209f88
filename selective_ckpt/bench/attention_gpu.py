"""GPU attention sweep: each Triton kernel timed on its own (forward, delta pre-pass, dK/dV, dQ) with
triton.testing.do_bench, against SDPA with the FLASH and the cuDNN backends pinned
(torch.nn.attention.sdpa_kernel), next to the chip's bf16 matmul rate measured in the same run;
then selective_ckpt.attention as callers run it, fwd and fwd+bwd, under each kernel it can dispatch to (the
setting forced per row: ours, PyTorch's FlashAttention, its memory-efficient kernel, and "auto"), per kind of call
(causal, none, padding, packed documents, sliding window, GQA, fp32), each row naming the kernel that ran; then a
7B-shaped SelectiveDecoderLayer training step (h=4096, 32 heads, bf16) with dropout on.

Shapes: bf16, B*S = 16384 tokens and H*D = 2048 at every point; S 1024..8192, D 64 and 128,
causal and not, dropout 0 and 0.1. FLOPs: forward 4*B*H*S*S*D (halved when causal); dK/dV does
two forward's worth (four matmuls), dQ one and a half (three); SDPA's backward 2.5 forwards.

    python -m selective_ckpt.bench.attention_gpu --out DIR [--quick] [--dry-run] [--no-dispatch | --dispatch-only]

Writes DIR/attention_gpu.csv (one row per point and implementation), DIR/attention_dispatch.csv (one row per
point, kind and setting, with the kernel that ran) and DIR/layer_7b.csv; prints the short tables last.
--dry-run checks arguments and prints the plan without touching a GPU.
"""

import argparse
import csv
import sys
import time

import torch

from .output import run_dir

FIELDS = ["seq", "dim", "heads", "batch", "causal", "dropout", "impl", "kernel", "ms", "tflops", "pct_matmul",
          "max_mem_mib"]


def plan(quick):
    seqs = (1024, 4096) if quick else (1024, 2048, 4096, 8192)
    for d in (64, 128):
        for s in seqs:
            for causal in (False, True):
                for p in (0.0, 0.1):
                    yield s, d, causal, p


def matmul_tflops(do_bench):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200)
    return 2 * n**3 / ms / 1e9


def ours(S, D, causal, p, do_bench):
    """{kernel: ms} for the four Triton kernels at one point, and the point's peak memory."""
    from selective_ckpt import rng
    from selective_ckpt.triton_kernels import attention as tk
    from selective_ckpt.triton_kernels.philox import seed_tensor

    B, H = 16384 // S, 2048 // D
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    o = torch.empty(B, S, H, D, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1, 3)
    lse = torch.empty(B, H, S, device="cuda")
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    g = torch.empty_like(qkv)
    dq, dk, dv = (g[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    dl = torch.empty(B, H, S, device="cuda")
    t16, ks = rng.threshold(p), rng.keep_scale(p)
    seed = seed_tensor(12345, "cuda") if p > 0 else None
    scale = D**-0.5
    common = (None, None, causal, 0, scale, 0.0, seed, t16, ks)  # no soft-capping
    torch.cuda.reset_peak_memory_stats()
    tk.forward(q, k, v, o, lse, *common)
    bwd = (do, q, k, v, lse, dl, *common)
    times = {
        "fwd": do_bench(lambda: tk.forward(q, k, v, o, lse, *common)),
        "delta": do_bench(lambda: tk.delta(o, do, dl)),
        "dkdv": do_bench(lambda: tk.backward_dkdv(*bwd, dk, dv)),
        "dq": do_bench(lambda: tk.backward_dq(*bwd, dq)),
    }
    return times, torch.cuda.max_memory_allocated() / 2**20


def sdpa(S, D, causal, p, backend, do_bench):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    B, H = 16384 // S, 2048 // D
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel([which]):
        fwd = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal))
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        bwd = do_bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    return {"fwd": fwd, "bwd": bwd}, torch.cuda.max_memory_allocated() / 2**20


# Forward-equivalents of matmul work per kernel (see the module doc).
WORK = {"fwd": 1.0, "delta": 0.0, "dkdv": 2.0, "dq": 1.5, "bwd": 2.5, "fwd+bwd": 3.5}

# The op's kinds of call: (dtype, H / Hkv, keyword arguments from S); each at B*S = 16384 tokens, H*D = 2048.
KINDS = {
    "causal": (torch.bfloat16, 1, lambda S: dict(causal=True)),
    "none": (torch.bfloat16, 1, lambda S: dict(causal=False)),
    "padding": (torch.bfloat16, 1, lambda S: dict(causal=True, padding=True)),
    "documents": (torch.bfloat16, 1, lambda S: dict(causal=True, documents=S)),
    "window": (torch.bfloat16, 1, lambda S: dict(causal=True, sliding_window=S // 4)),
    "gqa": (torch.bfloat16, 4, lambda S: dict(causal=True)),
    "fp32": (torch.float32, 1, lambda S: dict(causal=True)),
}
SETTINGS = ("ours", "sdpa_flash", "sdpa_efficient", "auto")
DISPATCH_FIELDS = ["seq", "dim", "kind", "setting", "kernel_ran", "step", "ms", "tflops"]


def dispatch_plan(quick):
    for S in ((4096,) if quick else (1024, 4096)):
        for D in (64, 128):
            for kind in KINDS:
                if D == 64 and kind not in ("causal", "none"):
                    continue
                yield S, D, kind


def dispatched(S, D, kind, setting, do_bench):
    """The kernel the op ran under `setting` and {step: ms} for its forward and forward+backward."""
    import selective_ckpt
    from selective_ckpt.ops import attention_dispatch

    dtype, group, make = KINDS[kind]
    kw = make(S)
    docs, padding = kw.pop("documents", None), kw.pop("padding", False)
    B, H = (1, 2048 // D) if docs else (16384 // S, 2048 // D)
    T = 16384 if docs else S  # documents: 16384 / S documents of S tokens packed in one row
    Hkv = H // group
    qkv = torch.randn(B, T, H + 2 * Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    q, k, v = (qkv[:, :, a:b].permute(0, 2, 1, 3) for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    if docs:
        kw["cu_seqlens"] = torch.arange(0, T + 1, docs, dtype=torch.int32, device="cuda")
    if padding:  # the last quarter of every row's keys padded
        kw["key_padding_mask"] = (torch.arange(T, device="cuda") < T - T // 4).expand(B, T).contiguous()
    do = torch.randn(B, H, T, D, device="cuda", dtype=dtype)
    selective_ckpt.set_attention_backend(setting)
    ran = attention_dispatch.choose_for(q, k, kw.get("key_padding_mask"), kw.get("cu_seqlens"), kw["causal"],
                                        kw.get("sliding_window", 0), 0.0, 0.0, 0)
    fwd = do_bench(lambda: selective_ckpt.attention(q, k, v, **kw))
    both = do_bench(lambda: torch.autograd.grad(selective_ckpt.attention(q, k, v, **kw), qkv, do))
    return ran, {"fwd": fwd, "fwd+bwd": both}


def dispatch_sweep(quick, do_bench, out):
    """Every kind of call under every setting; rows to attention_dispatch.csv."""
    import selective_ckpt
    from selective_ckpt import backend

    rows = []
    before = backend.attention_setting()
    try:
        for S, D, kind in dispatch_plan(quick):
            dense = 4 * 16384 * S * 2048 * (0.5 if KINDS[kind][2](S).get("causal") else 1.0)
            for setting in SETTINGS:
                try:
                    ran, times = dispatched(S, D, kind, setting, do_bench)
                except Exception as e:  # a kernel that fails here is a finding: the row says so
                    print(f"dispatch S={S} D={D} {kind} {setting}: failed ({type(e).__name__}: {str(e)[:160]})",
                          flush=True)
                    rows.append(dict(seq=S, dim=D, kind=kind, setting=setting, kernel_ran="failed", step="-",
                                     ms="", tflops=""))
                    continue
                for step, ms in times.items():
                    tf = WORK[step] * dense / ms / 1e9  # nominal: dense-causal FLOPs, whatever the mask skips
                    rows.append(dict(seq=S, dim=D, kind=kind, setting=setting, kernel_ran=ran, step=step,
                                     ms=round(ms, 4), tflops=round(tf, 1)))
                    print(f"dispatch S={S:5d} D={D:3d} {kind:9s} {setting:14s} ran {ran:14s} {step:7s} {ms:8.3f} ms "
                          f"{tf:6.1f} TFLOP/s", flush=True)
                torch.cuda.empty_cache()
    finally:
        selective_ckpt.set_attention_backend(before)
    with open(out / "attention_dispatch.csv", "w", newline="") as f:
        w = csv.DictWriter(f, DISPATCH_FIELDS)
        w.writeheader()
        w.writerows(rows)
    return rows


def dispatch_table(rows):
    """fwd+bwd ms per kind under each setting, the kernel that ran in brackets; best = the fastest setting."""
    print("\n== attention dispatch, fwd+bwd ms [kernel that ran]; auto should be the fastest of the row")
    print(f"{'seq':>5} {'D':>4} {'kind':>9} " + " ".join(f"{s:>26}" for s in SETTINGS))
    get = {(r["seq"], r["dim"], r["kind"], r["setting"]): r for r in rows if r["step"] in ("fwd+bwd", "-")}
    for S, D, kind in dict.fromkeys((r["seq"], r["dim"], r["kind"]) for r in rows):
        cells = []
        for s in SETTINGS:
            r = get.get((S, D, kind, s))
            cells.append("-" if r is None else f"{r['ms'] or 'n/a'} [{r['kernel_ran']}]")
        print(f"{S:5d} {D:4d} {kind:>9} " + " ".join(f"{c:>26}" for c in cells))


def layer_7b(seq, dropout, repeats=10):
    """Step time (ms) and peak memory (MiB) of a 7B-shaped SelectiveDecoderLayer forward+backward."""
    import selective_ckpt

    torch.manual_seed(0)
    layer = selective_ckpt.SelectiveDecoderLayer(4096, 32, dropout=dropout, attn_dropout=dropout, device="cuda",
                                                 dtype=torch.bfloat16)
    x = torch.randn(1, seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)
    for _ in range(3):
        layer(x).backward(gy)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(repeats):
        layer(x).backward(gy)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3, torch.cuda.max_memory_allocated() / 2**20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for the CSVs (default: a new folder per run, "
                                                "./bench-runs/<UTC time>-attention-gpu)")
    ap.add_argument("--quick", action="store_true", help="S 1024 and 4096 only")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no GPU needed")
    ap.add_argument("--no-dispatch", dest="dispatch", action="store_false",
                    help="skip the op's dispatch rows (every kernel it can run, per kind of call)")
    ap.add_argument("--dispatch-only", action="store_true", help="the op's dispatch rows alone")
    args = ap.parse_args(argv)
    points = list(plan(args.quick))
    if args.dry_run:
        extra = len(list(dispatch_plan(args.quick))) if args.dispatch else 0
        if args.dispatch_only:
            points = []
        print(f"[dry-run] {len(points)} points x (4 Triton kernels + SDPA flash/cudnn fwd, bwd); {extra} dispatch "
              f"points x {len(SETTINGS)} settings ({', '.join(SETTINGS)}), kinds {', '.join(KINDS)}; 7B layer "
              f"seq 2048/4096 dropout 0/0.1; CSVs under {args.out or './bench-runs/<UTC time>-attention-gpu'}")
        return 0
    import triton
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=40)

    out = run_dir(args.out, "attention-gpu")
    print(f"writing to {out.resolve()}", flush=True)
    if args.dispatch_only:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        drows = dispatch_sweep(args.quick, bench, out)
        dispatch_table(drows)
        return 1 if any(r["kernel_ran"] == "failed" for r in drows) else 0
    peak = matmul_tflops(do_bench)
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s on {torch.cuda.get_device_name()} (triton {triton.__version__})",
          flush=True)
    rows, failed = [], 0
    for S, D, causal, p in points:
        B, H = 16384 // S, 2048 // D
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        base = dict(seq=S, dim=D, heads=H, batch=B, causal=causal, dropout=p)
        impls = [("triton", ours, ()), ("sdpa_flash", sdpa, ("flash",)), ("sdpa_cudnn", sdpa, ("cudnn",))]
        for impl, fn, extra in impls:
            try:
                times, mem = fn(S, D, causal, p, *extra, bench)
            except Exception as e:  # a pinned SDPA backend may not take this point (e.g. dropout)
                print(f"{impl} S={S} D={D} causal={causal} p={p}: n/a ({type(e).__name__}: {str(e)[:120]})")
                failed += impl == "triton"
                continue
            for kernel, ms in times.items():
                tf = WORK[kernel] * flops / ms / 1e9 if WORK[kernel] else 0.0
                rows.append(dict(base, impl=impl, kernel=kernel, ms=round(ms, 4), tflops=round(tf, 1),
                                 pct_matmul=round(100 * tf / peak, 1), max_mem_mib=round(mem)))
                print(f"S={S:5d} D={D:3d} causal={causal!s:5} p={p:.1f} {impl:11s} {kernel:5s} {ms:8.3f} ms "
                      f"{tf:6.1f} TFLOP/s {100 * tf / peak:5.1f}% mem {mem:7.0f} MiB", flush=True)
            torch.cuda.empty_cache()
    with open(out / "attention_gpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    drows = dispatch_sweep(args.quick, bench, out) if args.dispatch else []  # before the 7B layer: the same process
    layer_rows = []
    for seq in (2048, 4096):
        for p in (0.0, 0.1):
            ms, mem = layer_7b(seq, p)
            layer_rows.append(dict(seq=seq, dropout=p, step_ms=round(ms, 2), max_mem_mib=round(mem)))
            print(f"7B layer seq {seq} dropout {p}: {ms:.2f} ms/step, max memory {mem:.0f} MiB", flush=True)
    with open(out / "layer_7b.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["seq", "dropout", "step_ms", "max_mem_mib"])
        w.writeheader()
        w.writerows(layer_rows)
    short_table(rows, layer_rows, peak)
    if drows:
        dispatch_table(drows)
    return 1 if failed or any(r["kernel_ran"] == "failed" for r in drows) else 0


def short_table(rows, layer_rows, peak):
    """Forward TFLOP/s (ours, flash, cudnn) and our dropout cost, per point; the 7B layer last."""
    print(f"\n== attention bf16, forward TFLOP/s (matmul peak {peak:.0f}); drop = our fwd time p=0.1 / p=0")
    print(f"{'seq':>5} {'D':>4} {'causal':>6} {'ours':>6} {'%mm':>5} {'flash':>6} {'cudnn':>6} {'drop':>5}")
    get = {(r["seq"], r["dim"], r["causal"], r["dropout"], r["impl"], r["kernel"]): r for r in rows}
    for S, D, causal, p in plan(False):
        if p or (S, D, causal, 0.0, "triton", "fwd") not in get:
            continue
        o = get[(S, D, causal, 0.0, "triton", "fwd")]
        o1 = get.get((S, D, causal, 0.1, "triton", "fwd"))
        fl = get.get((S, D, causal, 0.0, "sdpa_flash", "fwd"), {}).get("tflops", "-")
        cu = get.get((S, D, causal, 0.0, "sdpa_cudnn", "fwd"), {}).get("tflops", "-")
        drop = f"{o1['ms'] / o['ms']:.2f}" if o1 else "-"
        print(f"{S:5d} {D:4d} {causal!s:>6} {o['tflops']:6.1f} {o['pct_matmul']:5.1f} {fl:>6} {cu:>6} {drop:>5}")
    for r in layer_rows:
        print(f"7B layer seq {r['seq']} dropout {r['dropout']}: {r['step_ms']} ms/step, {r['max_mem_mib']} MiB")


if __name__ == "__main__":
    sys.exit(main())
