"""The main job's output: the table, a one-line summary per sequence length, the CSV and the plots."""

import csv
import datetime
import platform
from pathlib import Path

import torch

from .. import memory
from ..memory.units import columns
from .config import ROW_LABELS


def _mib(n):
    return f"{n / 2**20:.1f}"


def _ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def format_table(results, cfg):
    head = ("seq", "row", "kept/layer MiB", "vs eager", f"{cfg['model_layers']}-layer kept GiB", "peak MiB",
            "step ms", "p20-p80 ms", "min ms", "vs eager", "vs sdpa", "vs none", "max batch")
    lines = []
    for r in results:
        lines.append((str(r["seq"]), ROW_LABELS[r["row"]], _mib(r["kept_bytes_per_layer"]), _ratio(r["kept_vs_eager"]),
                      f"{r['model_kept_bytes'] / 2**30:.2f}", _mib(r["peak_bytes"]), f"{r['step_s'] * 1e3:.1f}",
                      f"{r['step_s_p20'] * 1e3:.1f}-{r['step_s_p80'] * 1e3:.1f}", f"{r['step_s_min'] * 1e3:.1f}",
                      _ratio(r["time_vs_eager"]), _ratio(r.get("time_vs_sdpa")), _ratio(r["time_vs_none"]),
                      str(r["max_batch"])))
    table = columns(head, lines, right=set(range(2, len(head))))
    out = table[:2]
    prev = None
    for r, row in zip(results, table[2:]):
        if prev is not None and r["seq"] != prev:
            out.append("")
        prev = r["seq"]
        out.append(row)
    return "\n".join(out)


def describe(cfg):
    return (f"device={cfg['device']} dtype={str(cfg['dtype']).replace('torch.', '')} hidden={cfg['hidden']} "
            f"heads={cfg['heads']} mlp_ratio={cfg['mlp_ratio']:g} layers={cfg['layers']} batch={cfg['batch']} "
            f"seq={','.join(map(str, cfg['seqs']))} causal={cfg['causal']} repeats={cfg['repeats']} "
            f"warmup={cfg['warmup']} budget={memory.format_bytes(cfg['budget'])} model_layers={cfg['model_layers']} "
            f"torch={torch.__version__} threads={torch.get_num_threads()}"
            + (f"\nLlama rows: kv_heads={cfg['llama_kv_heads']} ffn={cfg['llama_ffn']} swiglu rmsnorm rope"
               if any(r.startswith("llama") for r in cfg["rows"]) else "")
            + (f"\n{cfg['llama_note']}" if cfg.get("llama_note") else ""))


def summary(results):
    lines = []
    by = {(r["seq"], r["row"]): r for r in results}
    for seq in sorted({r["seq"] for r in results}):
        sel = by.get((seq, "selective"))
        if sel is None:
            continue
        parts = [f"seq {seq}: selective"]
        if sel["kept_vs_eager"] is not None:
            parts[0] += f" keeps {_ratio(sel['kept_vs_eager'])} eager's activations"
        if sel["time_vs_eager"] is not None:
            parts.append(f"step {_ratio(sel['time_vs_eager'])} eager")
        if sel["time_vs_none"] is not None:
            parts.append(f"{_ratio(sel['time_vs_none'])} none")
        if sel.get("time_vs_sdpa") is not None:
            parts.append(f"{_ratio(sel['time_vs_sdpa'])} the SDPA layer")
        full, ckpt = by.get((seq, "full")), by.get((seq, "sdpa-ckpt"))
        if full is not None and ckpt is not None:
            parts.append(f"full {_ratio(full['step_s'] / ckpt['step_s'])} the SDPA layer under torch checkpoint")
        lines.append(", ".join(parts))
        llama = by.get((seq, "llama-selective"))
        if llama is not None and llama["kept_vs_eager"] is not None:
            lines.append(f"seq {seq}: Llama selective keeps {_ratio(llama['kept_vs_eager'])} the Llama SDPA layer's "
                         f"activations, step {_ratio(llama['time_vs_sdpa'])} it")
    return "\n".join(lines)


CSV_FIELDS = ("device", "dtype", "hidden", "heads", "mlp_ratio", "layers", "batch", "seq", "row",
              "kept_bytes_per_layer", "kept_vs_eager", "model_layers", "model_kept_bytes", "peak_bytes", "step_s",
              "step_s_min", "step_s_p20", "step_s_p80", "time_vs_eager", "time_vs_sdpa", "time_vs_none",
              "activation_memory_budget", "param_bytes_per_layer", "budget_bytes", "max_batch", "timestamp",
              "machine", "threads", "torch", "triton", "selective_ckpt")


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def environment(cfg):
    """Where and when the figures were measured: the CSV's last columns."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    from .. import __version__

    machine = torch.cuda.get_device_name(0) if cfg["device"] == "cuda" else _cpu_name()
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "triton": triton_version, "selective_ckpt": __version__}


def write_csv(results, cfg, path):
    env = environment(cfg)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow({**r, **env, "device": cfg["device"], "dtype": str(cfg["dtype"]).replace("torch.", ""),
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
    paths.append(_tradeoff_plot(plt, results, cfg, Path(out) / "tradeoff.png"))
    return paths


def _tradeoff_plot(plt, results, cfg, path):
    """Kept bytes against step time, one point per row and sequence length: the choice a user makes."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in cfg["rows"]:
        pts = [(r["step_s"] * 1e3, r["kept_bytes_per_layer"] / 2**20, r["seq"]) for r in results if r["row"] == row]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=ROW_LABELS[row])
        for t, k, seq in pts:
            ax.annotate(str(seq), (t, k), fontsize=6, xytext=(2, 2), textcoords="offset points")
    ax.set_xlabel("forward+backward step (ms)")
    ax.set_ylabel("kept for backward per layer (MiB)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title("memory against time (labels: sequence length)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
