"""The main job's output: the table, a one-line summary per sequence length, the CSV and the plots."""

import csv
import datetime
import importlib.metadata
from pathlib import Path

import torch

from .. import memory
from ..memory.units import columns
from .config import ROW_LABELS


def _mib(n):
    return f"{n / 2**20:.1f}"


def _ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def row_label(r):
    """The table's name for a result: its row's label; an SDPA row timed in a compiled row's process says so."""
    if r.get("process", "main") != "main" and r["row"] != r["process"]:
        return f"{ROW_LABELS[r['row']]} (in the {r['process']} process)"
    if r["row"] == "sdpa-compile-budget" and r.get("activation_memory_budget") is not None:
        return f"SDPA layer, compile budget {r['activation_memory_budget']:g}"  # --compile-budget's value
    return ROW_LABELS[r["row"]]


def format_table(results, cfg):
    head = ("seq", "row", "kept/layer MiB", "kept vs eager", f"{cfg['model_layers']}-layer kept GiB", "peak MiB",
            "step ms", "p20-p80 ms", "min ms", "time vs eager", "time vs sdpa", "time vs none", "max batch")
    lines = []
    for r in results:
        lines.append((str(r["seq"]), row_label(r), _mib(r["kept_bytes_per_layer"]), _ratio(r["kept_vs_eager"]),
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
    out += ["", *ratio_legend(results)]
    return "\n".join(out)


def ratio_legend(results):
    """What each ratio column divides by: rows of the table above, same sequence length."""
    rows = {r["row"] for r in results}
    lines = [f"ratios are to rows of this table at the same seq: kept/time vs eager to '{ROW_LABELS['eager']}', "
             f"time vs sdpa to '{ROW_LABELS['sdpa']}', time vs none to '{ROW_LABELS['none']}'"]
    if any(r.startswith("llama") for r in rows):
        lines.append(f"Llama rows: kept/time vs eager and time vs sdpa are to '{ROW_LABELS['llama-sdpa']}'")
    compiled = {r["row"]: row_label(r) for r in results if r.get("process", "main") == r["row"]}
    for process in sorted({r["process"] for r in results if r.get("process", "main") != "main"}):
        lines.append(f"'{compiled.get(process, ROW_LABELS[process])}' ran in a process of its own (one compile "
                     f"budget per process), beside an SDPA layer timed there ('{ROW_LABELS['sdpa']} (in the {process} "
                     f"process)'): its time vs sdpa is to that row; its other ratios are to rows of the main process")
    return lines


def describe(cfg):
    from .output import cpu_name, kernel_isa

    cpu = f"cpu={cpu_name()} cpp_kernels_isa={kernel_isa()}"
    gpu = f" gpu={torch.cuda.get_device_name(0)}" if cfg["device"] == "cuda" else ""
    return (f"device={cfg['device']} dtype={str(cfg['dtype']).replace('torch.', '')} hidden={cfg['hidden']} "
            f"heads={cfg['heads']} mlp_ratio={cfg['mlp_ratio']:g} layers={cfg['layers']} batch={cfg['batch']} "
            f"seq={','.join(map(str, cfg['seqs']))} causal={cfg['causal']} repeats={cfg['repeats']} "
            f"warmup={cfg['warmup']} budget={memory.format_bytes(cfg['budget'])} model_layers={cfg['model_layers']} "
            f"torch={torch.__version__} threads={torch.get_num_threads()}\n{cpu}{gpu}"
            + (f"\nLlama rows: kv_heads={cfg['llama_kv_heads']} ffn={cfg['llama_ffn']} swiglu rmsnorm rope"
               if any(r.startswith("llama") for r in cfg["rows"]) else "")
            + (f"\n{cfg['llama_note']}" if cfg.get("llama_note") else ""))


QUICK_CAVEAT = ("--quick: tiny shapes and 3 timed steps, a check that the job runs; its times and time ratios are "
                "noise, not measurements (run without --quick for figures)")


def summary(results, quick=False):
    """One line per length on the selective row's ratios (and the Llama rows'); --quick's caveat first."""
    lines = []
    by = {(r["seq"], r["row"]): r for r in results if r.get("process", "main") == "main"}
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
    if lines and quick:
        lines.insert(0, QUICK_CAVEAT)
    return "\n".join(lines)


CSV_FIELDS = ("device", "dtype", "hidden", "heads", "mlp_ratio", "layers", "batch", "seq", "row", "process",
              "kept_bytes_per_layer", "kept_vs_eager", "model_layers", "model_kept_bytes", "peak_bytes", "step_s",
              "step_s_min", "step_s_p20", "step_s_p80", "time_vs_eager", "time_vs_sdpa", "time_vs_none",
              "ratio_base_eager", "ratio_base_sdpa", "activation_memory_budget", "param_bytes_per_layer",
              "budget_bytes", "max_batch", "timestamp", "machine", "cpu", "cpp_kernels_isa", "load_avg_peak", "quick",
              "threads", "torch", "triton", "selective_ckpt")


def environment(cfg):
    """Where and when the figures were measured: the CSV's last columns."""
    try:  # the installed version, without importing triton (an optional dependency)
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "-"
    from .. import __version__
    from .output import cpu_name, kernel_isa

    machine = torch.cuda.get_device_name(0) if cfg["device"] == "cuda" else cpu_name()
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine, "cpu": cpu_name(), "cpp_kernels_isa": kernel_isa(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "triton": triton_version, "selective_ckpt": __version__,
            "load_avg_peak": cfg.get("load_avg_peak", ""), "quick": int(bool(cfg.get("quick")))}


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


# One colour and marker per row, line style per family (dashed: nn.MultiheadAttention layer, reds; dash-dot: the
# SDPA layer, blues; solid: SelectiveDecoderLayer; dotted: the Llama-style layers, purples). Our four rows,
# the ones read against each other, take hues of their own (green, brown, magenta, black) and unlike markers.
STYLES = {
    "eager": ("#99000d", "o", "--"), "eager-ckpt": ("#e6550d", "s", "--"), "eager-sac": ("#fd8d3c", "^", "--"),
    "sdpa": ("#08306b", "D", "-."), "sdpa-ckpt": ("#2171b5", "v", "-."), "sdpa-compile": ("#6baed6", "P", "-."),
    "sdpa-compile-budget": ("#17becf", "X", "-."),
    "none": ("#8c510a", "o", "-"), "selective": ("#1a9641", "*", "-"), "full": ("#e7298a", "s", "-"),
    "selective-compile": ("#000000", "d", "-"),
    "llama-sdpa": ("#54278f", "<", ":"), "llama-selective": ("#9e9ac8", ">", ":"),
}


def _plotted(results, cfg):
    """{row: its results sorted by seq}, the main process's rows and the compiled rows (not the SDPA rows
    timed beside them, which repeat the SDPA layer), in the table's order."""
    series = {}
    for row in cfg["rows"]:
        pts = sorted((r for r in results if r["row"] == row and r.get("process", "main") in ("main", row)),
                     key=lambda r: r["seq"])
        if pts:
            series[row] = pts
    return series


def _title(cfg, what):
    return (f"{what}\nh={cfg['hidden']} a={cfg['heads']} B={cfg['batch']} {cfg['layers']} layer(s) "
            f"{str(cfg['dtype']).replace('torch.', '')} on {cfg['device']}" + (" (--quick: times are noise)"
                                                                               if cfg.get("quick") else ""))


def timing_note(cfg):
    """The mark a plot of times carries when the load average showed other work while the rows were timed
    (the console's warning, short), or None."""
    from .output import busy_note

    return busy_note(cfg.get("load_avg_peak"))


def _finish(fig, ax, path, title, note=None):
    if note:  # in the title, and across the plot behind the data, in red, where it cannot be missed
        ax.text(0.5, 0.5, "busy machine:\nunreliable times", transform=ax.transAxes, ha="center", va="center",
                fontsize=26, color="#cc0000", alpha=0.15, fontweight="bold", rotation=20, zorder=0)
        title = f"{title}\n{note}"
    ax.set_title(title, fontsize=9, color="#cc0000" if note else "black")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    fig.savefig(path, dpi=130, bbox_inches="tight")


def write_plots(results, cfg, out):
    """kept_memory.png, step_time.png and tradeoff.png; returns the paths, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series = _plotted(results, cfg)
    seqs = sorted({r["seq"] for pts in series.values() for r in pts})
    # rows that coincide (the checkpointed layers keep the same bytes) sit side by side around each length
    n = len(series)
    dodge = {row: 2 ** (0.045 * (i - (n - 1) / 2)) for i, row in enumerate(series)}
    paths = []

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for row, pts in series.items():
        color, marker, line = STYLES[row]
        ax.plot([r["seq"] * dodge[row] for r in pts], [r["kept_bytes_per_layer"] / 2**20 for r in pts], color=color,
                marker=marker, linestyle=line, markersize=6, label=ROW_LABELS[row])
    _log_axes(ax, seqs, "kept for backward per layer (MiB, log)")
    paths.append(Path(out) / "kept_memory.png")
    _finish(fig, ax, paths[-1], _title(cfg, "activation bytes kept for backward, per layer"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for row, pts in series.items():
        color, marker, line = STYLES[row]
        mid = [r["step_s"] * 1e3 for r in pts]
        err = [[m - r["step_s_p20"] * 1e3 for m, r in zip(mid, pts)],
               [r["step_s_p80"] * 1e3 - m for m, r in zip(mid, pts)]]
        ax.errorbar([r["seq"] * dodge[row] for r in pts], mid, yerr=err, color=color, marker=marker, linestyle=line,
                    markersize=6, capsize=3, elinewidth=1, label=ROW_LABELS[row])
    _log_axes(ax, seqs, "forward+backward step (ms, log): median, bars p20-p80")
    paths.append(Path(out) / "step_time.png")
    _finish(fig, ax, paths[-1], _title(cfg, "step time"), timing_note(cfg))
    plt.close(fig)

    paths.append(_tradeoff_plot(plt, series, seqs, cfg, Path(out) / "tradeoff.png"))
    return paths


def _log_axes(ax, seqs, ylabel):
    """Log-log axes over the sequence lengths (rows are dodged around each length)."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.set_xlabel("sequence length (rows side by side around each length)")
    ax.set_ylabel(ylabel)


def _tradeoff_plot(plt, series, seqs, cfg, path):
    """Kept bytes against step time: one line per row through its sequence lengths (marker size grows
    with the length), hollow markers so that coinciding rows stay visible; p20-p80 as horizontal bars."""
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    size = {s: 4 + 4 * i for i, s in enumerate(seqs)}
    for row, pts in series.items():
        color, marker, line = STYLES[row]
        x = [r["step_s"] * 1e3 for r in pts]
        y = [r["kept_bytes_per_layer"] / 2**20 for r in pts]
        ax.plot(x, y, color=color, linestyle=line, linewidth=1, alpha=0.8)
        ax.errorbar(x, y, xerr=[[a - r["step_s_p20"] * 1e3 for a, r in zip(x, pts)],
                                [r["step_s_p80"] * 1e3 - a for a, r in zip(x, pts)]],
                    fmt="none", ecolor=color, elinewidth=0.8, alpha=0.6)
        for a, b, r in zip(x, y, pts):
            ax.plot([a], [b], marker=marker, markersize=size[r["seq"]], markerfacecolor="none", markeredgecolor=color,
                    markeredgewidth=1.5, linestyle="none")
        ax.plot([], [], color=color, marker=marker, linestyle=line, markerfacecolor="none", markeredgewidth=1.5,
                label=ROW_LABELS[row])
    for s in seqs:  # a key for the marker sizes
        ax.plot([], [], marker="o", color="0.4", markerfacecolor="none", markersize=size[s], linestyle="none",
                label=f"seq {s}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("forward+backward step (ms, log; bars p20-p80)")
    ax.set_ylabel("kept for backward per layer (MiB, log)")
    _finish(fig, ax, path, _title(cfg, "memory against time: lower left is better; lines join a row's lengths"),
            timing_note(cfg))
    plt.close(fig)
    return path
