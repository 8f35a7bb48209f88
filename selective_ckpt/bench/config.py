"""Rows, default configurations and the command line of the main job (see selective_ckpt/bench/__init__.py)."""

import argparse
import importlib
import re

import torch

from .. import memory

ROWS = ("eager", "eager-ckpt", "eager-sac", "sdpa", "sdpa-ckpt", "sdpa-compile", "sdpa-compile-budget", "none",
        "selective", "full", "selective-compile", "llama-sdpa", "llama-selective")
# torch.compile rows run in a subprocess each: compiled graphs and the activation_memory_budget are
# process-wide, so one process measures one budget (docs/DESIGN.md, Known traps). The budget row's
# value is --compile-budget's (0.5 unless given).
COMPILED_ROWS = {"sdpa-compile": None, "sdpa-compile-budget": 0.5, "selective-compile": None}
ROW_LABELS = {
    "eager": "eager (nn.MultiheadAttention)",
    "eager-ckpt": "eager + torch checkpoint",
    "eager-sac": "eager + SAC (save matmuls)",
    "sdpa": "SDPA layer",
    "sdpa-ckpt": "SDPA layer + torch checkpoint",
    "sdpa-compile": "SDPA layer, torch.compile",
    "sdpa-compile-budget": "SDPA layer, compile budget 0.5",
    "none": "SelectiveDecoderLayer none",
    "selective": "SelectiveDecoderLayer selective",
    "full": "SelectiveDecoderLayer full",
    "selective-compile": "SelectiveDecoderLayer selective, torch.compile",
    "llama-sdpa": "Llama SDPA layer",
    "llama-selective": "Llama SelectiveDecoderLayer selective",
}

CONFIGS = {
    "cpu": dict(hidden=512, heads=8, layers=2, batch=2, seqs=(256, 512, 1024), dtype="fp32", repeats=5, warmup=1),
    "quick": dict(hidden=128, heads=4, layers=1, batch=2, seqs=(64, 128), dtype="fp32", repeats=3, warmup=1,
                  rows=tuple(r for r in ROWS if r not in COMPILED_ROWS)),
    "cuda": dict(hidden=4096, heads=32, layers=1, batch=1, seqs=(2048, 4096, 8192), dtype="bf16", repeats=10,
                 warmup=3),
}
# The Llama-style rows: the same hidden size and heads, kv heads = heads / 4 (grouped-query, where
# heads allow it and the attention kernels take it), SwiGLU of width 3.5 h, RMSNorm, RoPE.
LLAMA_KV_RATIO = 4
LLAMA_FFN_RATIO = 3.5
LLAMA_ROPE_THETA = 500000.0
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


def _fraction(text):
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return v


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


def _epilog():
    doc = importlib.import_module(__package__).__doc__ or ""
    return doc[doc.find("Rows, measured"):]


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m selective_ckpt.bench",
        description="Activation memory (saved-tensor ledger), step peak memory and step time of the reference\n"
                    "eager decoder layer (plain, under torch checkpoint, under selective checkpointing of matmuls)\n"
                    "and of SelectiveDecoderLayer (recompute none / selective / full). Defaults depend on --device:\n"
                    "cpu h=512 a=8, 2 layers, B=2, seq 256,512,1024, fp32, 5 timed steps after 1 warm-up;\n"
                    "cuda the 7B layer h=4096 a=32, 1 layer, B=1, seq 2048,4096,8192, bf16, 10 after 3.",
        epilog=_epilog(),
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
    p.add_argument("--rows", type=_row_list, default=None,
                   help="comma-separated rows to run: " + ",".join(ROWS) + " (default: all; --quick skips the "
                        "torch.compile rows)")
    p.add_argument("--model-layers", type=_positive, default=MODEL_LAYERS,
                   help="depth L of the model the max-batch and model-memory columns are projected to")
    p.add_argument("--budget", type=parse_budget, default=None,
                   help="memory budget for the max-batch column: bytes (8GiB, 80GB, 12e9) or a percentage of the "
                        f"device's memory (default: 80%% on cuda, {CPU_BUDGET // 2**30}GiB on cpu)")
    p.add_argument("--compile-budget", type=_fraction, default=COMPILED_ROWS["sdpa-compile-budget"],
                   help="torch._functorch.config.activation_memory_budget of the sdpa-compile-budget row, in (0, 1]: "
                        "e.g. the budget at which the compiled SDPA layer keeps what selective-compile keeps")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention")
    p.add_argument("--out", default=None,
                   help="folder for results.csv and the PNG plots (default: a new folder per run, "
                        "./bench-runs/<UTC time>-<cpu|cuda|quick>, printed at the end)")
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
        "rows": list(args.rows or base.get("rows", ROWS)),
        "model_layers": args.model_layers,
        "causal": args.causal,
        "compile_budget": args.compile_budget,
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
    cfg["llama_ffn"] = int(LLAMA_FFN_RATIO * cfg["hidden"])
    cfg["llama_kv_heads"], cfg["llama_note"] = llama_kv_heads(cfg["heads"], device)
    return cfg


def llama_kv_heads(heads, device):
    """(kv heads of the Llama rows, a note or ""): heads / 4 when the attention kernels on `device` take
    grouped k/v, else heads, so both Llama rows compare the same shape."""
    from ..ops.attention import attention

    if heads % LLAMA_KV_RATIO:
        return heads, f"Llama rows: {heads} heads do not split {LLAMA_KV_RATIO}:1, kv heads = heads"
    kv = heads // LLAMA_KV_RATIO
    q = torch.zeros(1, heads, 2, 8, device=device)
    k = torch.zeros(1, kv, 2, 8, device=device)
    try:
        attention(q, k, k, causal=True)
    except NotImplementedError as err:
        return heads, f"Llama rows: grouped-query attention not available here ({err}), kv heads = heads"
    return kv, ""
