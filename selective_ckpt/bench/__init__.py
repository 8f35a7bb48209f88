"""The main job: activation memory, peak memory and step time of one decoder layer stack, eleven ways,
plus a Llama-style layer two ways.

    python -m selective_ckpt.bench                 # CPU: h=512, a=8, 2 layers, B=2, seq 256/512/1024
    python -m selective_ckpt.bench --quick         # tiny CPU config (< 1 minute)
    python -m selective_ckpt.bench --device cuda   # 7B layer: h=4096, a=32, bf16, seq 2048/4096/8192

Rows, measured in the same run on the same input:
  eager            the reference eager layer: pre-LN, nn.MultiheadAttention with its default arguments, GELU MLP
  eager-ckpt       that layer under torch.utils.checkpoint(use_reentrant=False), per layer
  eager-sac        that layer under PyTorch's selective checkpoint policy saving matmul outputs
  sdpa             the same layer as users write it today: nn modules around scaled_dot_product_attention
  sdpa-ckpt        that layer under torch.utils.checkpoint(use_reentrant=False), per layer
  sdpa-compile     that layer stack under torch.compile (default settings)
  sdpa-compile-budget   the same with torch._functorch.config.activation_memory_budget = 0.5 (--compile-budget)
                   (each compiled row runs in a process of its own, with an SDPA layer timed beside it
                   there and printed under it, "SDPA layer (in the ... process)": the compiled row's
                   "time vs sdpa" is to that row; --quick skips them)
  none / selective / full   SelectiveDecoderLayer with that recompute mode
  selective-compile   the selective stack under torch.compile (a process of its own, like the SDPA
                   compiled rows: compare its "time vs sdpa" with sdpa-compile-budget's, both to the
                   SDPA layer timed in their own process)
  llama-sdpa       a Llama-style layer (same hidden size and heads, kv heads = heads / 4, RMSNorm,
                   RoPE, SwiGLU of width 3.5 h, no biases) on nn modules and SDPA (enable_gqa)
  llama-selective  SelectiveDecoderLayer of that shape, selective; its "kept/time vs eager" and
                   "time vs sdpa" ratios are to llama-sdpa. Where the attention kernels do not take grouped k/v
                   yet, both Llama rows run with kv heads = heads (the header says so)

Columns:
  kept/layer   bytes kept for backward per layer: selective_ckpt.memory.ledger (saved-tensor hooks,
               distinct storage, parameters excluded), total over the stack / layers
  peak         peak bytes allocated by one forward+backward step above what was live before it
               (parameters, input; grads set to None first). CUDA: torch.cuda.max_memory_allocated.
               CPU: memory.cpu_peak_bytes, the running sum of the profiler's allocation events.
  step         median wall time of a forward+backward step over --repeats runs (rows interleaved
               run by run, so load drift on a shared machine hits all rows alike), its 20th-80th
               percentile spread, and its ratios ("time vs ...") to the eager row, to the SDPA layer row
               and to the "none" row of the same length (the legend under the table names each base);
               "min ms" is the fastest run, the least disturbed one
  max batch    largest batch of a --model-layers model that fits --budget, projected linearly from
               this run: weights + grads (2 * params) + b * ((L - N) * kept/layer + step peak
               above grads) / B, where N is the measured stack's depth and B its batch
Output: a header with the CPU model and the ISA the C++ kernels run, the table on stdout, results.csv
(with the machine, versions, the peak load average and a timestamp on every row) and, with matplotlib,
kept_memory.png, step_time.png (p20-p80 bars) and tradeoff.png (kept bytes against step time) in the
run's own folder: --out, or ./bench-runs/<UTC time>-<config>, printed at the end. A warning follows
the table when the load average shows other work on the CPUs while the rows were timed.
"""

from .config import (
    COMPILED_ROWS,
    CONFIGS,
    CPU_BUDGET,
    LLAMA_FFN_RATIO,
    LLAMA_KV_RATIO,
    MODEL_LAYERS,
    ROW_LABELS,
    ROWS,
    build_parser,
    llama_kv_heads,
    parse_budget,
    resolve_config,
)
from .output import LoadWatch, run_dir
from .report import QUICK_CAVEAT, describe, format_table, summary, write_csv, write_plots
from .runner import Progress, Step, build_stack, measure_peak, run, sync

__all__ = ["COMPILED_ROWS", "CONFIGS", "CPU_BUDGET", "LLAMA_FFN_RATIO", "LLAMA_KV_RATIO", "MODEL_LAYERS", "Progress",
           "ROWS", "ROW_LABELS", "Step", "build_parser", "build_stack", "describe", "format_table", "llama_kv_heads",
           "main", "measure_peak", "parse_budget", "resolve_config", "run", "summary", "sync", "write_csv",
           "write_plots"]


def main(argv=None):
    args = build_parser().parse_args(argv)
    cfg = resolve_config(args)
    cfg["seed"], cfg["quick"] = args.seed, args.quick
    out = run_dir(args.out, "quick" if args.quick else cfg["device"])
    print(describe(cfg), flush=True)
    if args.quick:
        print(QUICK_CAVEAT, flush=True)
    watch = LoadWatch()
    results = run(cfg, progress=not args.no_progress, watch=watch)
    cfg["load_avg_peak"] = "" if watch.peak is None else round(watch.peak, 2)
    print(format_table(results, cfg))
    text = summary(results, quick=args.quick)
    if text:
        print(text)
    busy = watch.warning()
    if busy:
        print(busy)
    write_csv(results, cfg, out / "results.csv")
    if not args.no_plots:
        paths = write_plots(results, cfg, out)
        if paths is None:
            print("matplotlib is not installed: skipped the plots (pip install matplotlib, or selective_ckpt[bench])")
    names = ["results.csv"] + ([] if args.no_plots or paths is None else [p.name for p in paths])
    print(f"wrote {', '.join(names)} to {out.resolve()}")
    return results
