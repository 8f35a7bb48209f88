"""Hugging Face rows of the main job: small Llama and GPT-2 models, as transformers trains them and converted.

    python -m selective_ckpt.bench.hf            # CPU: hidden 256, 2 layers, batch 2, seq 256 and 512
    python -m selective_ckpt.bench.hf --quick    # tiny shapes (well under a minute)

Rows per model, measured in one run on the same tokens (labels = inputs, loss backward):
  sdpa        the model as transformers builds it, attn_implementation="sdpa"
  hf-ckpt     that model with model.gradient_checkpointing_enable() (each decoder layer re-run)
  selective   selective_ckpt.convert(model): our kernels, norm/activation outputs rebuilt in backward

Columns:
  kept/layer  bytes one decoder layer keeps alive for backward after a training forward: the
              profiler's allocation deltas of an L-layer model minus a 1-layer one, over L - 1
              (sees what custom ops allocate, and what saved-tensor hooks drop)
  floor       memory.estimate("selective") for the layer's shape: what the converted layer must keep
  step        median wall time of a training step over --repeats runs, rows interleaved run by run
              (load drift on a shared machine hits all rows alike), its p20-p80 spread, and the
              ratio of medians to the sdpa row of the same model and length
"""

import argparse
import csv
import gc
import sys
import time

import torch

from .. import memory
from ..models import convert
from ..models.hf import converted_layers
from .output import run_dir
from .runner import _spread

ROWS = ("sdpa", "hf-ckpt", "selective")
MODELS = ("llama", "gpt2")
CONFIGS = {
    "default": dict(hidden=256, heads=8, kv_heads=2, ffn=688, layers=2, vocab=512, batch=2, seqs=(256, 512),
                    repeats=9, warmup=2),
    "quick": dict(hidden=64, heads=4, kv_heads=2, ffn=176, layers=2, vocab=128, batch=2, seqs=(48,),
                  repeats=3, warmup=1),
}


def build_model(kind, row, cfg, layers=None):
    """A freshly initialised model (seed 0) for `row`; `layers` overrides the depth."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    n = layers or cfg["layers"]
    seq = max(cfg["seqs"])
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                             num_hidden_layers=n, num_attention_heads=cfg["heads"],
                             num_key_value_heads=cfg["kv_heads"], max_position_embeddings=seq,
                             attention_dropout=cfg["dropout"], use_cache=False)
        model = LlamaForCausalLM(config)
    elif kind == "gpt2":
        p = cfg["dropout"]
        # bos/eos inside the small vocabulary (GPT-2's 50256 is outside it, and transformers warns)
        config = GPT2Config(vocab_size=cfg["vocab"], n_embd=cfg["hidden"], n_layer=n, n_head=cfg["heads"],
                            n_positions=seq, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False,
                            bos_token_id=cfg["vocab"] - 1, eos_token_id=cfg["vocab"] - 1)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {kind!r}")
    model.config._attn_implementation = "sdpa"
    model.train()
    if row == "hf-ckpt":
        if hasattr(model, "activation_checkpointing_enable"):  # the name gradient_checkpointing_enable warns there
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif row == "selective":
        convert(model)
    elif row != "sdpa":
        raise ValueError(f"row must be one of {', '.join(ROWS)}, got {row!r}")
    return model


def _kept_after_forward(model, ids):
    held = []
    gc.collect()
    gc.disable()  # garbage collected inside the window would count as negative deltas
    try:
        deltas = memory.cpu_allocation_deltas(lambda: held.append(model(input_ids=ids, labels=ids).loss))
    finally:
        gc.enable()
    return sum(deltas)


def kept_bytes_per_layer(kind, row, cfg, ids):
    one = _kept_after_forward(build_model(kind, row, cfg, layers=1), ids)
    many = _kept_after_forward(build_model(kind, row, cfg), ids)
    return (many - one) // (cfg["layers"] - 1)


def floor_bytes(model, batch, seq):
    """memory.estimate("selective") of the converted model's first decoder layer."""
    fields = converted_layers(model)[0]._selective_ckpt.shape()
    return memory.estimate(fields.pop("hidden_dim"), fields.pop("num_heads"), seq, batch, fields.pop("dtype"),
                           fields.pop("mlp_ratio"), "selective", **fields)


class TrainStep:
    def __init__(self, model, ids):
        self.model, self.ids = model, ids
        self.params = [p for p in model.parameters() if p.requires_grad]

    def __call__(self):
        for p in self.params:
            p.grad = None
        t0 = time.perf_counter()
        self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        return time.perf_counter() - t0


def measure(cfg, models=MODELS, progress=True):
    """One result dict per (model, seq, row): kept bytes per layer, floor, step-time spread and ratio."""
    results = []
    for kind in models:
        for seq in cfg["seqs"]:
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, cfg["vocab"], (cfg["batch"], seq), generator=g)
            built = {row: build_model(kind, row, cfg) for row in ROWS}
            res = {row: {"model": kind, "seq": seq, "row": row} for row in ROWS}
            floor = floor_bytes(built["selective"], cfg["batch"], seq)
            for row in ROWS:
                if progress:
                    print(f"[{kind} s={seq}] {row}: kept bytes", file=sys.stderr, flush=True)
                res[row]["kept_bytes_per_layer"] = kept_bytes_per_layer(kind, row, cfg, ids)
                res[row]["floor_bytes_per_layer"] = floor
            steps = {row: TrainStep(built[row], ids) for row in ROWS}
            for _ in range(cfg["warmup"]):
                for row in ROWS:
                    steps[row]()
            times = {row: [] for row in ROWS}
            if progress:
                print(f"[{kind} s={seq}] timing {cfg['repeats']} interleaved rounds", file=sys.stderr, flush=True)
            for _ in range(cfg["repeats"]):
                for row in ROWS:
                    times[row].append(steps[row]())
            for row in ROWS:
                r = res[row]
                r["step_s"], r["step_s_min"], r["step_s_p20"], r["step_s_p80"] = _spread(times[row])
            for row in ROWS:
                res[row]["vs_sdpa"] = res[row]["step_s"] / res["sdpa"]["step_s"]
            results += [res[row] for row in ROWS]
            del built, steps
    return results


def format_table(results, cfg):
    tokens = cfg["batch"]
    lines = [f"{'model':6s} {'seq':>5s} {'row':10s} {'kept/layer':>11s} {'B/token':>8s} {'floor':>11s} "
             f"{'vs floor':>8s} {'step ms':>8s} {'p20-p80 ms':>14s} {'vs sdpa':>8s}"]
    for r in results:
        t = tokens * r["seq"]
        kept, floor = r["kept_bytes_per_layer"], r["floor_bytes_per_layer"]
        lines.append(f"{r['model']:6s} {r['seq']:5d} {r['row']:10s} {memory.format_bytes(kept):>11s} "
                     f"{kept / t:8.1f} {memory.format_bytes(floor):>11s} {kept / floor:7.2f}x "
                     f"{1000 * r['step_s']:8.1f} {1000 * r['step_s_p20']:6.1f}-{1000 * r['step_s_p80']:<7.1f} "
                     f"{r['vs_sdpa']:7.3f}x")
    return "\n".join(lines)


def write_csv(results, path):
    fields = ["model", "seq", "row", "kept_bytes_per_layer", "floor_bytes_per_layer", "step_s", "step_s_min",
              "step_s_p20", "step_s_p80", "vs_sdpa"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields + ["torch", "threads"])
        w.writeheader()
        for r in results:
            w.writerow({**{k: r[k] for k in fields}, "torch": torch.__version__, "threads": torch.get_num_threads()})


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m selective_ckpt.bench.hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repeats")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default per config)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--dropout", type=float, default=0.0, help="attention (Llama) / all (GPT-2) dropout rates")
    ap.add_argument("--out", default=None, help="folder for results.csv (default: a new folder per run, "
                                                   "./bench-runs/<UTC time>-hf[-quick], printed at the end)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "default"], dropout=args.dropout)
    for key in ("seqs", "batch", "repeats"):
        if getattr(args, key) is not None:
            cfg[key] = tuple(getattr(args, key)) if key == "seqs" else getattr(args, key)
    if cfg["layers"] < 2:
        raise ValueError("layers must be at least 2 (bytes per layer are L layers minus one)")
    print(f"Hugging Face models on {torch.get_num_threads()} CPU threads, float32: hidden {cfg['hidden']}, "
          f"{cfg['heads']} heads (Llama: {cfg['kv_heads']} kv heads, ffn {cfg['ffn']}; GPT-2: ffn 4h), "
          f"{cfg['layers']} layers, batch {cfg['batch']}, dropout {cfg['dropout']}, {cfg['repeats']} timed rounds",
          flush=True)
    results = measure(cfg, args.models, progress=not args.no_progress)
    print(format_table(results, cfg))
    out = run_dir(args.out, "hf-quick" if args.quick else "hf")
    write_csv(results, out / "results.csv")
    print(f"wrote results.csv to {out.resolve()}")
    return results


if __name__ == "__main__":
    main()
