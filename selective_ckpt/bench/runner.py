"""Builds each row's layer stack and measures it: ledger, step peak memory and interleaved step times."""

import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import memory
from ..layers import SelectiveDecoderLayer
from ..models.eager import EagerDecoderLayer
from .config import COMPILED_ROWS, LLAMA_ROPE_THETA
from .llama_sdpa import LlamaSDPALayer
from .sdpa_layer import SDPADecoderLayer


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
    factory = {"device": cfg["device"], "dtype": cfg["dtype"]}
    h, a, r, causal = cfg["hidden"], cfg["heads"], cfg["mlp_ratio"], cfg["causal"]
    layers = []
    for _ in range(cfg["layers"]):
        if row in ("none", "selective", "full", "selective-compile"):
            mode = row.removesuffix("-compile")
            layers.append(SelectiveDecoderLayer(h, a, mlp_ratio=r, causal=causal, recompute=mode, **factory))
            continue
        if row == "llama-sdpa":
            layers.append(LlamaSDPALayer(h, a, cfg["llama_kv_heads"], cfg["llama_ffn"], LLAMA_ROPE_THETA,
                                         causal=causal, **factory))
            continue
        if row == "llama-selective":
            layers.append(SelectiveDecoderLayer(h, a, causal=causal, bias=False, num_kv_heads=cfg["llama_kv_heads"],
                                                ffn_dim=cfg["llama_ffn"], norm="rmsnorm", activation="swiglu",
                                                rope_theta=LLAMA_ROPE_THETA, **factory))
            continue
        if row.startswith("sdpa"):
            layer = SDPADecoderLayer(h, a, mlp_ratio=r, causal=causal, **factory)
        else:
            layer = EagerDecoderLayer(h, a, mlp_ratio=r, causal=causal, **factory)
        if row.endswith("-ckpt"):
            layer = Checkpointed(layer)
        elif row == "eager-sac":
            layer = Checkpointed(layer, memory.sac_context_fn())
        layers.append(layer)
    stack = nn.Sequential(*layers).train()
    # The process's activation_memory_budget applies (set by selective_ckpt.bench.compiled).
    return torch.compile(stack) if row in COMPILED_ROWS else stack


def sync(device):
    """Waits for the device's queued work, so wall-clock times cover it (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
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
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step.forward_backward()
        sync(device)
        return torch.cuda.max_memory_allocated() - base
    return memory.cpu_peak_bytes(step.forward_backward)


def _time_once(step, device):
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


PROGRESS_TAG = "@progress "  # a compiled row's process reports each update on stderr behind this tag


class Progress:
    """A bar (tqdm) or plain "[done/total] what" lines on stderr; `relay=True` prints tagged lines for
    the parent process instead (a compiled row's process), which feeds them into its own bar."""

    def __init__(self, total, enabled, relay=False):
        self.total, self.done, self.enabled, self.relay = total, 0, enabled, relay
        self.bar = None
        if enabled and not relay:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, what, n=1):
        self.done += n
        if self.relay:
            print(f"{PROGRESS_TAG}{n} {what}", file=sys.stderr, flush=True)
        elif self.bar is not None:
            self.bar.set_description(what, refresh=False)
            self.bar.update(n)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def progress_steps(cfg, n_rows):
    """Progress updates `measure` makes for n_rows rows over all sequence lengths."""
    return len(cfg["seqs"]) * n_rows * (2 + _warm_steps(cfg) + cfg["repeats"])


def _warm_steps(cfg):
    # CPU: the profiled step doubles as the first warm-up step. CUDA: peak after warm-up, so one-off
    # allocations (Triton compilation, cuBLAS workspaces) stay out of it.
    return max(0, cfg["warmup"] - 1) if cfg["device"] == "cpu" else cfg["warmup"]


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _spread(times):
    """(median, fastest, p20, p80) of a row's step times."""
    q = statistics.quantiles(times, n=5, method="inclusive") if len(times) > 1 else [times[0]] * 4
    return statistics.median(times), min(times), q[0], q[3]


def measure(cfg, rows, prog, watch=None):
    """Ledger, peak and interleaved step times of `rows` (built in this process) at every sequence length;
    `watch` (output.LoadWatch) samples the load average once per timing round."""
    device, n = cfg["device"], cfg["layers"]
    warm = _warm_steps(cfg)
    results = []
    for seq in cfg["seqs"]:
        torch.manual_seed(cfg.get("seed", 0))
        x = torch.randn(cfg["batch"], seq, cfg["hidden"], device=device, dtype=cfg["dtype"], requires_grad=True)
        gy = torch.randn_like(x)
        models = {row: build_stack(row, cfg) for row in rows}
        steps = {row: Step(models[row], x, gy) for row in rows}
        res = {row: {"seq": seq, "row": row} for row in rows}
        for row in rows:
            prog.update(f"s={seq} {row}: ledger")
            if row in COMPILED_ROWS:  # the ledger's hooks would make the compiled graph fall back to eager
                steps[row]()
                kept = memory.graph_saved_bytes(models[row](x), exclude=[models[row]])
            else:
                kept = memory.ledger(models[row], x).total
            res[row]["kept_bytes_per_layer"] = kept // n
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
            if watch is not None:
                watch.sample()
        for row in rows:
            r = res[row]
            r["step_s"], r["step_s_min"], r["step_s_p20"], r["step_s_p80"] = _spread(times[row])
        del models, steps
        results += [res[row] for row in rows]
    return results


def _measure_compiled(cfg, row, prog):
    """One torch.compile row in its own process, with the plain SDPA row timed beside it there; its
    progress lines feed `prog`. Returns its results: the compiled row's and that process's SDPA row's,
    both marked with "process": row."""
    spec = {k: v for k, v in cfg.items() if k != "rows"}
    spec["dtype"] = str(cfg["dtype"]).replace("torch.", "")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "selective_ckpt.bench.compiled", row, json.dumps(spec)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        stdout = []
        reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
        reader.start()
        errors = []
        for line in proc.stderr:
            if line.startswith(PROGRESS_TAG):
                n, what = line[len(PROGRESS_TAG):].rstrip("\n").split(" ", 1)
                prog.update(f"{row} (own process) {what}", int(n))
            else:
                errors.append(line)
        proc.wait()
        reader.join()
    if proc.returncode != 0:
        raise RuntimeError(f"the {row} row failed in its process:\n{''.join(errors)[-4000:]}")
    return json.loads("".join(stdout).strip().splitlines()[-1])


def run(cfg, progress=True, watch=None):
    """Measure every row at every sequence length; returns a list of result dicts. Compiled rows bring
    the SDPA row of their own process along ("process": the compiled row; in-process rows: "main")."""
    rows = cfg["rows"]
    local = [r for r in rows if r not in COMPILED_ROWS]
    compiled = [r for r in rows if r in COMPILED_ROWS]
    prog = Progress(progress_steps(cfg, len(local)) + len(compiled) * progress_steps(cfg, 2), progress)
    try:
        results = measure(cfg, local, prog, watch) if local else []
        for r in results:
            r["process"] = "main"
        for row in compiled:
            if watch is not None:
                watch.sample()
            results += _measure_compiled(cfg, row, prog)
            if watch is not None:
                watch.sample()
    finally:
        prog.close()
    order = {r: i for i, r in enumerate(rows)}
    # a compiled row's own SDPA row follows it
    results.sort(key=lambda r: (cfg["seqs"].index(r["seq"]), order[r["process"] if r["process"] != "main" else
                                                                   r["row"]], r["row"] == "sdpa"))
    _derive(results, cfg)
    return results


def _derive(results, cfg):
    """Ratios and the projected max batch / model memory columns. Every ratio is to a row of the table:
    kept and time vs eager, time vs none to the main process's rows of the same length; time vs sdpa to
    the SDPA row timed in the same process (a compiled row's own one); the Llama rows' ratios to the
    Llama SDPA layer. The ratio_base_* fields name the row and process each ratio used."""
    by = {(r["seq"], r["row"], r["process"]): r for r in results}
    L, n, B = cfg["model_layers"], cfg["layers"], cfg["batch"]
    for r in results:
        seq = r["seq"]
        eager, none = by.get((seq, "eager", "main")), by.get((seq, "none", "main"))
        sdpa = by.get((seq, "sdpa", r["process"]))
        if r["row"].startswith("llama"):  # the Llama rows' baseline is the Llama layer on SDPA
            eager = sdpa = by.get((seq, "llama-sdpa", "main"))
            none = None
        r["kept_vs_eager"] = r["kept_bytes_per_layer"] / eager["kept_bytes_per_layer"] if eager else None
        r["time_vs_eager"] = r["step_s"] / eager["step_s"] if eager else None
        r["time_vs_none"] = r["step_s"] / none["step_s"] if none else None
        r["time_vs_sdpa"] = r["step_s"] / sdpa["step_s"] if sdpa else None
        r["ratio_base_eager"] = f"{eager['row']}@{eager['process']}" if eager else ""
        r["ratio_base_sdpa"] = f"{sdpa['row']}@{sdpa['process']}" if sdpa else ""
        P = r["param_bytes_per_layer"]
        r["model_kept_bytes"] = L * r["kept_bytes_per_layer"]
        work = max(0, r["peak_bytes"] - n * P)  # the step's peak above the gradients it allocates
        per_sample = ((L - n) * r["kept_bytes_per_layer"] + work) / B
        free = cfg["budget"] - 2 * L * P
        r["max_batch"] = int(free // per_sample) if free > 0 and per_sample > 0 else 0
