"""The main job: activation memory, peak memory and step time of one decoder layer stack, six ways.

    python -m selective_ckpt.bench                 # CPU: h=512, a=8, 2 layers, B=2, seq 256/512/1024
    python -m selective_ckpt.bench --quick         # tiny CPU config (< 1 minute)
    python -m selective_ckpt.bench --device cuda   # 7B layer: h=4096, a=32, bf16, seq 2048/4096/8192

Rows, measured in the same run on the same input:
  eager            the seeds' layer: pre-LN, nn.MultiheadAttention with its default arguments, GELU MLP
  eager-ckpt       that layer under torch.utils.checkpoint(use_reentrant=False), per layer
  eager-sac        that layer under PyTorch's selective checkpoint policy saving matmul outputs
  none / selective / full   SelectiveDecoderLayer with that recompute mode

Columns:
  kept/layer   bytes kept for backward per layer: selective_ckpt.memory.ledger (saved-tensor hooks,
               distinct storage, parameters excluded), total over the stack / layers
  peak         peak bytes allocated by one forward+backward step above what was live before it
               (parameters, input; grads set to None first). CUDA: torch.cuda.max_memory_allocated.
               CPU: memory.cpu_peak_bytes, the running sum of the profiler's allocation events.
  step         median wall time of a forward+backward step over --repeats runs (rows interleaved
               run by run, so load drift on a shared machine hits all rows alike), and its ratio to
               eager and to "none"; "min ms" is the fastest run, the least disturbed one
  max batch    largest batch of a --model-layers model that fits --budget, projected linearly from
               this run: weights + grads (2 * params) + b * ((L - N) * kept/layer + step peak
               above grads) / B, where N is the measured stack's depth and B its batch
Output: the table on stdout, results.csv and (with matplotlib) kept_memory.png and step_time.png in --out.
"""

import argparse
import csv
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import memory
from .baseline import EagerDecoderLayer

ROWS = ("eager", "eager-ckpt", "eager-sac", "none", "selective", "full")
ROW_LABELS = {
    "eager": "eager (nn.MultiheadAttention)",
    "eager-ckpt": "eager + torch checkpoint",
    "eager-sac": "eager + SAC (save matmuls)",
    "none": "SelectiveDecoderLayer none",
    "selective": "SelectiveDecoderLayer selective",
    "full": "SelectiveDecoderLayer full",
}

CONFIGS = {
    "cpu": dict(hidden=512, heads=8, layers=2, batch=2, seqs=(256, 512, 1024), dtype="fp32", repeats=5, warmup=1),
    "quick": dict(hidden=128, heads=4, layers=1, batch=2, seqs=(64, 128), dtype="fp32", repeats=3, warmup=1),
    "cuda": dict(hidden=4096, heads=32, layers=1, batch=1, seqs=(2048, 4096, 8192), dtype="bf16", repeats=10,
                 warmup=3),
}
CPU_BUDGET = 8 * 2**30
MODEL_LAYERS = 32

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(text):
    """'8GiB', '80GB', '12e9', '80%' (of the device's memory) -> (bytes or None, fraction or None)."""
    s = str(text).strip().lower().replace(" ", "")
    if s.endswith("%"):
        try:
            frac = float(s[:-1]) / 100
        except ValueError:
            frac = -1
        if not 0 < frac <= 1:
            raise argparse.ArgumentTypeError(f"--budget percentage must be in (0, 100], got {text!r}")
        return None, frac
    m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"--budget must be bytes like 8GiB, 80GB, 12e9 or a percentage, got {text!r}")
    n = float(m.group(1)) * _UNITS[m.group(2)]
    if n <= 0:
        raise argparse.ArgumentTypeError(f"--budget must be positive, got {text!r}")
    return int(n), None


def _int_list(text):
    try:
        vals = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive ints, got {text!r}")
    return vals


def _row_list(text):
    rows = [r.strip() for r in str(text).split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if not rows or bad:
        raise argparse.ArgumentTypeError(f"rows must be a comma-separated subset of {','.join(ROWS)}, got {text!r}")
    return rows


def _positive(text):
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows a flag's default unless its help already explains it; keeps the epilog as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        default = ",".join(action.default) if isinstance(action.default, list) else action.default
        return f"{text} (default: {default})"


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m selective_ckpt.bench",
        description="Activation memory (saved-tensor ledger), step peak memory and step time of the seeds'\n"
                    "eager decoder layer (plain, under torch checkpoint, under selective checkpointing of matmuls)\n"
                    "and of SelectiveDecoderLayer (recompute none / selective / full). Defaults depend on --device:\n"
                    "cpu h=512 a=8, 2 layers, B=2, seq 256,512,1024, fp32, 5 timed steps after 1 warm-up;\n"
                    "cuda the 7B layer h=4096 a=32, 1 layer, B=1, seq 2048,4096,8192, bf16, 10 after 3.",
        epilog=__doc__[__doc__.index("Rows, measured"):],
        formatter_class=_HelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where to run (default: cuda when available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny CPU config for tests: h=128 a=4 1 layer seq 64,128")
    p.add_argument("--hidden", type=_positive, default=None, help="hidden size h (default per device)")
    p.add_argument("--heads", type=_positive, default=None, help="attention heads a (default per device)")
    p.add_argument("--mlp-ratio", type=float, default=4.0, help="MLP width / hidden")
    p.add_argument("--layers", type=_positive, default=None, help="layers in the measured stack N (default per device)")
    p.add_argument("--batch", type=_positive, default=None, help="batch size B (default per device)")
    p.add_argument("--seq", type=_int_list, default=None, help="comma-separated sequence lengths (default per device)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="parameter and activation dtype (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--repeats", type=_positive, default=None,
                   help="timed steps per row, median reported (default per device)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per row before timing; on cpu the first one runs under the memory profiler "
                        "(default per device)")
    p.add_argument("--rows", type=_row_list, default=list(ROWS), help="comma-separated rows to run: " + ",".join(ROWS))
    p.add_argument("--model-layers", type=_positive, default=MODEL_LAYERS,
                   help="depth L of the model the max-batch and model-memory columns are projected to")
    p.add_argument("--budget", type=parse_budget, default=None,
                   help="memory budget for the max-batch column: bytes (8GiB, 80GB, 12e9) or a percentage of the "
                        f"device's memory (default: 80%% on cuda, {CPU_BUDGET // 2**30}GiB on cpu)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention")
    p.add_argument("--out", default="bench/out", help="folder for results.csv and the PNG plots")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines on stderr")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for weights and inputs")
    return p


def resolve_config(args):
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.quick and device == "cuda":
        raise SystemExit("--quick is the tiny CPU config; use --device cpu (or drop --quick)")
    base = dict(CONFIGS["quick" if args.quick else device])
    cfg = {
        "device": device,
        "hidden": args.hidden or base["hidden"],
        "heads": args.heads or base["heads"],
        "mlp_ratio": args.mlp_ratio,
        "layers": args.layers or base["layers"],
        "batch": args.batch or base["batch"],
        "seqs": list(args.seq or base["seqs"]),
        "dtype": memory.as_dtype(args.dtype or base["dtype"]),
        "repeats": args.repeats or base["repeats"],
        "warmup": base["warmup"] if args.warmup is None else max(0, args.warmup),
        "rows": list(args.rows),
        "model_layers": args.model_layers,
        "causal": args.causal,
    }
    if cfg["hidden"] % cfg["heads"]:
        raise SystemExit(f"--hidden ({cfg['hidden']}) must be divisible by --heads ({cfg['heads']})")
    if not cfg["mlp_ratio"] > 0:
        raise SystemExit(f"--mlp-ratio must be positive, got {cfg['mlp_ratio']}")
    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    nbytes, frac = args.budget if args.budget is not None else ((None, 0.8) if device == "cuda" else (CPU_BUDGET, None))
    if frac is not None:
        if total is None:
            raise SystemExit("--budget as a percentage needs --device cuda (on cpu give bytes, e.g. 8GiB)")
        nbytes = int(total * frac)
    cfg["budget"] = nbytes
    return cfg


# ---------------------------------------------------------------------------------------------
# Models


class Checkpointed(nn.Module):
    """A layer run under torch.utils.checkpoint(use_reentrant=False), optionally with a context_fn."""

    def __init__(self, layer, context_fn=None):
        super().__init__()
        self.layer = layer
        self.context_fn = context_fn

    def forward(self, x):
        kwargs = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(self.layer, x, use_reentrant=False, **kwargs)


def build_stack(row, cfg):
    from .layers import SelectiveDecoderLayer

    factory = {"device": cfg["device"], "dtype": cfg["dtype"]}
    h, a, r, causal = cfg["hidden"], cfg["heads"], cfg["mlp_ratio"], cfg["causal"]
    layers = []
    for _ in range(cfg["layers"]):
        if row in ("none", "selective", "full"):
            layers.append(SelectiveDecoderLayer(h, a, mlp_ratio=r, causal=causal, recompute=row, **factory))
            continue
        layer = EagerDecoderLayer(h, a, mlp_ratio=r, causal=causal, **factory)
        if row == "eager-ckpt":
            layer = Checkpointed(layer)
        elif row == "eager-sac":
            layer = Checkpointed(layer, memory.sac_context_fn())
        layers.append(layer)
    return nn.Sequential(*layers).train()


# ---------------------------------------------------------------------------------------------
# Measurements


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Step:
    """One training step of `model` on x with output gradient gy; grads are set to None first."""

    def __init__(self, model, x, gy):
        self.model, self.x, self.gy = model, x, gy
        self.params = list(model.parameters())

    def zero(self):
        for prm in self.params:
            prm.grad = None
        self.x.grad = None

    def forward_backward(self):
        self.model(self.x).backward(self.gy)

    def __call__(self):
        self.zero()
        self.forward_backward()


def measure_peak(step, device):
    """Peak bytes a forward+backward allocates above what is live before it (grads None first)."""
    step.zero()
    if device == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step.forward_backward()
        _sync(device)
        return torch.cuda.max_memory_allocated() - base
    return memory.cpu_peak_bytes(step.forward_backward)


def _time_once(step, device):
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t0


class Progress:
    def __init__(self, total, enabled):
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, what, n=1):
        self.done += n
        if self.bar is not None:
            self.bar.set_description(what, refresh=False)
            self.bar.update(n)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(cfg, progress=True):
    """Measure every row at every sequence length; returns a list of result dicts."""
    device, rows, n = cfg["device"], cfg["rows"], cfg["layers"]
    # CPU: the profiled step doubles as the first warm-up step. CUDA: peak after warm-up, so one-off
    # allocations (Triton compilation, cuBLAS workspaces) stay out of it.
    warm = max(0, cfg["warmup"] - 1) if device == "cpu" else cfg["warmup"]
    prog = Progress(len(cfg["seqs"]) * len(rows) * (2 + warm + cfg["repeats"]), progress)
    results = []
    try:
        for seq in cfg["seqs"]:
            torch.manual_seed(cfg.get("seed", 0))
            x = torch.randn(cfg["batch"], seq, cfg["hidden"], device=device, dtype=cfg["dtype"], requires_grad=True)
            gy = torch.randn_like(x)
            models = {row: build_stack(row, cfg) for row in rows}
            steps = {row: Step(models[row], x, gy) for row in rows}
            res = {row: {"seq": seq, "row": row} for row in rows}
            for row in rows:
                prog.update(f"s={seq} {row}: ledger")
                res[row]["kept_bytes_per_layer"] = memory.ledger(models[row], x).total // n
                res[row]["param_bytes_per_layer"] = param_bytes(models[row]) // n
            for row in rows:
                if device == "cpu":
                    prog.update(f"s={seq} {row}: peak")
                    res[row]["peak_bytes"] = measure_peak(steps[row], device)
                for _ in range(warm):
                    steps[row]()
                    prog.update(f"s={seq} {row}: warmup")
                if device != "cpu":
                    prog.update(f"s={seq} {row}: peak")
                    res[row]["peak_bytes"] = measure_peak(steps[row], device)
            times = {row: [] for row in rows}
            for _ in range(cfg["repeats"]):
                for row in rows:
                    times[row].append(_time_once(steps[row], device))
                    prog.update(f"s={seq} {row}: timing")
            for row in rows:
                res[row]["step_s"] = statistics.median(times[row])
                res[row]["step_s_min"] = min(times[row])
            del models, steps
            results += [res[row] for row in rows]
    finally:
        prog.close()
    _derive(results, cfg)
    return results


def _derive(results, cfg):
    """Ratios and the projected max batch / model memory columns."""
    by = {(r["seq"], r["row"]): r for r in results}
    L, n, B = cfg["model_layers"], cfg["layers"], cfg["batch"]
    for r in results:
        eager, none = by.get((r["seq"], "eager")), by.get((r["seq"], "none"))
        r["kept_vs_eager"] = r["kept_bytes_per_layer"] / eager["kept_bytes_per_layer"] if eager else None
        r["time_vs_eager"] = r["step_s"] / eager["step_s"] if eager else None
        r["time_vs_none"] = r["step_s"] / none["step_s"] if none else None
        P = r["param_bytes_per_layer"]
        r["model_kept_bytes"] = L * r["kept_bytes_per_layer"]
        work = max(0, r["peak_bytes"] - n * P)  # the step's peak above the gradients it allocates
        per_sample = ((L - n) * r["kept_bytes_per_layer"] + work) / B
        free = cfg["budget"] - 2 * L * P
        r["max_batch"] = int(free // per_sample) if free > 0 and per_sample > 0 else 0


# ---------------------------------------------------------------------------------------------
# Output

def _mib(n):
    return f"{n / 2**20:.1f}"


def _ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def format_table(results, cfg):
    head = ("seq", "row", "kept/layer MiB", "vs eager", f"{cfg['model_layers']}-layer kept GiB", "peak MiB",
            "step ms", "min ms", "vs eager", "vs none", "max batch")
    lines = []
    for r in results:
        lines.append((str(r["seq"]), ROW_LABELS[r["row"]], _mib(r["kept_bytes_per_layer"]), _ratio(r["kept_vs_eager"]),
                      f"{r['model_kept_bytes'] / 2**30:.2f}", _mib(r["peak_bytes"]), f"{r['step_s'] * 1e3:.1f}",
                      f"{r['step_s_min'] * 1e3:.1f}", _ratio(r["time_vs_eager"]), _ratio(r["time_vs_none"]),
                      str(r["max_batch"])))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [fmt(head), fmt(["-" * w for w in widths])]
    prev = None
    for r, cells in zip(results, lines):
        if prev is not None and r["seq"] != prev:
            out.append("")
        prev = r["seq"]
        out.append(fmt(cells))
    return "\n".join(out)


def describe(cfg):
    return (f"device={cfg['device']} dtype={str(cfg['dtype']).replace('torch.', '')} hidden={cfg['hidden']} "
            f"heads={cfg['heads']} mlp_ratio={cfg['mlp_ratio']:g} layers={cfg['layers']} batch={cfg['batch']} "
            f"seq={','.join(map(str, cfg['seqs']))} causal={cfg['causal']} repeats={cfg['repeats']} "
            f"warmup={cfg['warmup']} budget={memory.format_bytes(cfg['budget'])} model_layers={cfg['model_layers']} "
            f"torch={torch.__version__} threads={torch.get_num_threads()}")


def summary(results):
    lines = []
    by = {(r["seq"], r["row"]): r for r in results}
    for seq in sorted({r["seq"] for r in results}):
        sel = by.get((seq, "selective"))
        if sel is None:
            continue
        parts = [f"seq {seq}: selective keeps {_ratio(sel['kept_vs_eager'])} eager's activations"]
        if sel["time_vs_eager"] is not None:
            parts.append(f"step {_ratio(sel['time_vs_eager'])} eager")
        if sel["time_vs_none"] is not None:
            parts.append(f"{_ratio(sel['time_vs_none'])} none")
        lines.append(", ".join(parts))
    return "\n".join(lines)


CSV_FIELDS = ("device", "dtype", "hidden", "heads", "mlp_ratio", "layers", "batch", "seq", "row",
              "kept_bytes_per_layer", "kept_vs_eager", "model_layers", "model_kept_bytes", "peak_bytes", "step_s",
              "step_s_min", "time_vs_eager", "time_vs_none", "param_bytes_per_layer", "budget_bytes", "max_batch")


def write_csv(results, cfg, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerow({**r, "device": cfg["device"], "dtype": str(cfg["dtype"]).replace("torch.", ""),
                        "hidden": cfg["hidden"], "heads": cfg["heads"], "mlp_ratio": cfg["mlp_ratio"],
                        "layers": cfg["layers"], "batch": cfg["batch"], "model_layers": cfg["model_layers"],
                        "budget_bytes": cfg["budget"]})


def write_plots(results, cfg, out):
    """kept_memory.png and step_time.png; returns the paths, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    paths = []
    for key, scale, ylabel, name in (("kept_bytes_per_layer", 2**-20, "kept for backward per layer (MiB)",
                                      "kept_memory.png"),
                                     ("step_s", 1e3, "forward+backward step (ms)", "step_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in cfg["rows"]:
            pts = sorted((r["seq"], r[key] * scale) for r in results if r["row"] == row)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=ROW_LABELS[row])
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_title(f"h={cfg['hidden']} a={cfg['heads']} B={cfg['batch']} {str(cfg['dtype']).replace('torch.', '')} "
                     f"on {cfg['device']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out) / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None):
    args = build_parser().parse_args(argv)
    cfg = resolve_config(args)
    cfg["seed"] = args.seed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(describe(cfg), flush=True)
    results = run(cfg, progress=not args.no_progress)
    print(format_table(results, cfg))
    text = summary(results)
    if text:
        print(text)
    write_csv(results, cfg, out / "results.csv")
    print(f"wrote {out / 'results.csv'}")
    if not args.no_plots:
        paths = write_plots(results, cfg, out)
        if paths is None:
            print("matplotlib is not installed: skipped the plots (pip install matplotlib, or selective_ckpt[bench])")
        else:
            print("wrote " + ", ".join(map(str, paths)))
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
