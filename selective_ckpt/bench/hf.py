"""Hugging Face rows of the main job: small Llama and GPT-2 models, as transformers trains them and converted.

    python -m selective_ckpt.bench.hf            # CPU: hidden 256, 2 layers, batch 2, seq 256 and 512
    python -m selective_ckpt.bench.hf --quick    # tiny shapes (well under a minute)
    python -m selective_ckpt.bench.hf --models --configs qlora   # only the QLoRA rows of the configurations

Rows per model, measured in one run on the same tokens (labels = inputs, loss backward):
  sdpa        the model as transformers builds it, attn_implementation="sdpa"
  hf-ckpt     that model with model.activation_checkpointing_enable() (each decoder layer re-run)
  selective   selective_ckpt.convert(model): our kernels, norm/activation outputs rebuilt in backward

Training configurations (--configs; a Llama of its own shape, hidden 128, 4 heads, 2 kv heads,
ffn 3.5h, 3 layers, S=128, B=2 by default), each with the same three rows:
  autocast           fp32 weights under torch.autocast(bfloat16) (Trainer's bf16=True), full fine-tune
  autocast-lora      the same with PEFT LoRA r=8 on all linear layers
  bf16-lora-dropout  bf16 weights, LoRA r=8 all-linear, lora_dropout=0.05
  qlora              bitsandbytes 4-bit NF4 base (bf16 compute), prepare_model_for_kbit_training, LoRA r=8
  qlora-dropout      the same with lora_dropout=0.05
Their floor is models.configuration.layer_estimate of the converted layer in that configuration.

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
import contextlib
import csv
import sys
import time

import torch

from .. import compat, memory
from ..models import convert
from ..registry import recomputable_layers
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
# training configurations: name -> (weights "fp32" / "bf16" / "nf4", autocast dtype, LoRA dropout or None)
TRAINING = {
    "autocast": ("fp32", torch.bfloat16, None),
    "autocast-lora": ("fp32", torch.bfloat16, 0.0),
    "bf16-lora-dropout": ("bf16", None, 0.05),
    "qlora": ("nf4", None, 0.0),
    "qlora-dropout": ("nf4", None, 0.05),
}
TRAINING_SHAPES = {
    "default": dict(hidden=128, heads=4, kv_heads=2, ffn=448, layers=3, vocab=512, batch=2, seqs=(128,),
                    repeats=9, warmup=2, lora_rank=8),
    "quick": dict(hidden=64, heads=4, kv_heads=2, ffn=176, layers=3, vocab=128, batch=2, seqs=(32,),
                  repeats=3, warmup=1, lora_rank=8),
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
    compat.set_attention_implementation(model.config, "sdpa")
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


def _quantized_nf4(model):
    """`model` saved and loaded again by transformers with a 4-bit NF4 base (bf16 compute), then
    prepared by peft for k-bit training (fp32 norms, no checkpointing here)."""
    import tempfile
    import warnings

    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig
    from transformers.utils import logging

    logging.disable_progress_bar()  # one bar per save and load would bury the table
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes on CPU, transformers' deprecation inside peft
        model.save_pretrained(path)
        model = type(model).from_pretrained(path, quantization_config=q, attn_implementation="sdpa")
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _enable_hf_checkpointing(model):
    if hasattr(model, "activation_checkpointing_enable"):  # the name gradient_checkpointing_enable warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_training_model(config, row, cfg, layers=None):
    """A Llama (seed 0) in training configuration `config` (TRAINING) for `row`; `layers` overrides the depth."""
    if config not in TRAINING:
        raise ValueError(f"config must be one of {', '.join(TRAINING)}, got {config!r}")
    if row not in ROWS:
        raise ValueError(f"row must be one of {', '.join(ROWS)}, got {row!r}")
    model = build_model("llama", "sdpa", dict(cfg, dropout=0.0), layers)
    weights, _, lora_dropout = TRAINING[config]
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    elif weights == "nf4":
        model = _quantized_nf4(model)
    if row == "hf-ckpt":
        _enable_hf_checkpointing(model)
    if lora_dropout is not None:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        r = cfg["lora_rank"]
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=lora_dropout,
                                                 target_modules="all-linear", init_lora_weights=False))
    if row == "selective":
        convert(model)
    return model.train()


def _autocast(dtype):
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def _kept_after_forward(model, ids, autocast_dtype=None):
    """Allocator deltas of one training forward (after a first, unmeasured one: bitsandbytes casts
    biases and transformers builds lazy buffers once)."""
    held = []
    with _autocast(autocast_dtype):
        model(input_ids=ids, labels=ids)

    def forward():
        with _autocast(autocast_dtype):
            held.append(model(input_ids=ids, labels=ids).loss)

    return sum(memory.cpu_allocation_deltas(forward))


def kept_bytes_per_layer(kind, row, cfg, ids):
    one = _kept_after_forward(build_model(kind, row, cfg, layers=1), ids)
    many = _kept_after_forward(build_model(kind, row, cfg), ids)
    return (many - one) // (cfg["layers"] - 1)


def training_kept_bytes_per_layer(config, row, cfg, ids):
    dtype = TRAINING[config][1]
    one = _kept_after_forward(build_training_model(config, row, cfg, layers=1), ids, dtype)
    many = _kept_after_forward(build_training_model(config, row, cfg), ids, dtype)
    return (many - one) // (cfg["layers"] - 1)


def training_floor_bytes(model, config, batch, seq):
    """layer_estimate of the converted model's first decoder layer in its training configuration."""
    from ..models.configuration import layer_estimate

    return layer_estimate(recomputable_layers(model)[0], seq, batch, TRAINING[config][1])


def floor_bytes(model, batch, seq):
    """memory.estimate("selective") of the converted model's first decoder layer."""
    fields = recomputable_layers(model)[0]._selective_ckpt.shape()
    return memory.estimate(fields.pop("hidden_dim"), fields.pop("num_heads"), seq, batch, fields.pop("dtype"),
                           fields.pop("mlp_ratio"), "selective", **fields)


class TrainStep:
    def __init__(self, model, ids, autocast_dtype=None):
        self.model, self.ids, self.autocast_dtype = model, ids, autocast_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]

    def __call__(self):
        for p in self.params:
            p.grad = None
        t0 = time.perf_counter()
        with _autocast(self.autocast_dtype):
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        return time.perf_counter() - t0


def _time_rows(steps, cfg, label, progress):
    """Interleaved step times per row: {row: (median, fastest, p20, p80)}, and per row the p20 and p80 of
    its time over the first row's in the same round (a ratio of adjacent runs, which load drift spares)."""
    for _ in range(cfg["warmup"]):
        for step in steps.values():
            step()
    times = {row: [] for row in steps}
    if progress:
        print(f"[{label}] timing {cfg['repeats']} interleaved rounds", file=sys.stderr, flush=True)
    for _ in range(cfg["repeats"]):
        for row, step in steps.items():
            times[row].append(step())
    first = next(iter(times.values()))
    ratios = {row: _spread([a / b for a, b in zip(t, first)])[2:] for row, t in times.items()}
    return {row: _spread(t) for row, t in times.items()}, ratios


def measure_training(cfg, configs=tuple(TRAINING), progress=True):
    """One result dict per (config, seq, row) of the training configurations (a Llama of cfg's shape)."""
    results = []
    for config in configs:
        dtype = TRAINING[config][1]
        for seq in cfg["seqs"]:
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, cfg["vocab"], (cfg["batch"], seq), generator=g)
            label = f"{config} s={seq}"
            res = {row: {"model": "llama", "config": config, "hidden": cfg["hidden"], "batch": cfg["batch"],
                         "seq": seq, "row": row}
                   for row in ROWS}
            for row in ROWS:
                if progress:
                    print(f"[{label}] {row}: kept bytes", file=sys.stderr, flush=True)
                res[row]["kept_bytes_per_layer"] = training_kept_bytes_per_layer(config, row, cfg, ids)
            built = {row: build_training_model(config, row, cfg) for row in ROWS}
            floor = training_floor_bytes(built["selective"], config, cfg["batch"], seq)
            spread, ratios = _time_rows({row: TrainStep(built[row], ids, dtype) for row in ROWS}, cfg, label,
                                        progress)
            for row in ROWS:
                r = res[row]
                r["floor_bytes_per_layer"] = floor
                r["step_s"], r["step_s_min"], r["step_s_p20"], r["step_s_p80"] = spread[row]
                r["vs_sdpa"] = r["step_s"] / spread["sdpa"][0]
                r["vs_sdpa_p20"], r["vs_sdpa_p80"] = ratios[row]
            results += [res[row] for row in ROWS]
            del built
    return results


def measure(cfg, models=MODELS, progress=True):
    """One result dict per (model, seq, row): kept bytes per layer, floor, step-time spread and ratio."""
    results = []
    for kind in models:
        for seq in cfg["seqs"]:
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, cfg["vocab"], (cfg["batch"], seq), generator=g)
            built = {row: build_model(kind, row, cfg) for row in ROWS}
            res = {row: {"model": kind, "config": "fp32", "hidden": cfg["hidden"], "batch": cfg["batch"],
                         "seq": seq, "row": row}
                   for row in ROWS}
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


def _ratio_spread(r):
    return f" ({r['vs_sdpa_p20']:.2f}-{r['vs_sdpa_p80']:.2f})" if "vs_sdpa_p20" in r else ""


def format_table(results, cfg=None):
    """One line per result; the "x 2h B" column is kept bytes over tokens * hidden * 2 (16-bit elements per
    token and hidden unit, the unit of docs/DESIGN.md's floor). `cfg` is not needed (each result has its shape)."""
    lines = [f"{'model':6s} {'config':17s} {'seq':>5s} {'row':10s} {'kept/layer':>11s} {'B/token':>8s} "
             f"{'x 2h B':>7s} {'floor':>11s} {'vs floor':>8s} {'step ms':>8s} {'p20-p80 ms':>14s} {'vs sdpa':>8s}"]
    for r in results:
        t = r["batch"] * r["seq"]
        kept, floor = r["kept_bytes_per_layer"], r["floor_bytes_per_layer"]
        lines.append(f"{r['model']:6s} {r['config']:17s} {r['seq']:5d} {r['row']:10s} "
                     f"{memory.format_bytes(kept):>11s} {kept / t:8.1f} {kept / (t * 2 * r['hidden']):6.1f}h "
                     f"{memory.format_bytes(floor):>11s} "
                     f"{kept / floor:7.2f}x "
                     f"{1000 * r['step_s']:8.1f} {1000 * r['step_s_p20']:6.1f}-{1000 * r['step_s_p80']:<7.1f} "
                     f"{r['vs_sdpa']:7.3f}x" + _ratio_spread(r))
    return "\n".join(lines)


def write_csv(results, path):
    fields = ["model", "config", "hidden", "batch", "seq", "row", "kept_bytes_per_layer", "floor_bytes_per_layer",
              "step_s", "step_s_min", "step_s_p20", "step_s_p80", "vs_sdpa", "vs_sdpa_p20", "vs_sdpa_p80"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields + ["torch", "threads"])
        w.writeheader()
        for r in results:
            w.writerow({**{k: r.get(k, "") for k in fields}, "torch": torch.__version__,
                        "threads": torch.get_num_threads()})


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m selective_ckpt.bench.hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repeats")
    ap.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS),
                    help="model rows (fp32 weights); an empty list runs none")
    ap.add_argument("--configs", nargs="*", choices=tuple(TRAINING), default=list(TRAINING),
                    help="training-configuration rows (a Llama of their own shape); an empty list runs none")
    ap.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default per config)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--dropout", type=float, default=0.0, help="attention (Llama) / all (GPT-2) dropout rates")
    ap.add_argument("--out", default=None, help="folder for results.csv (default: a new folder per run, "
                                                   "./bench-runs/<UTC time>-hf[-quick], printed at the end)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv=None):
    from ..fit.configs import MissingExtra, require

    args = build_parser().parse_args(argv)
    try:
        require("transformers", what="python -m selective_ckpt.bench.hf")
    except MissingExtra as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
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
    results = measure(cfg, args.models, progress=not args.no_progress) if args.models else []
    if args.configs:
        tcfg = dict(TRAINING_SHAPES["quick" if args.quick else "default"])
        for key in ("seqs", "batch", "repeats"):
            if getattr(args, key) is not None:
                tcfg[key] = tuple(getattr(args, key)) if key == "seqs" else getattr(args, key)
        print(f"Training configurations: Llama hidden {tcfg['hidden']}, {tcfg['heads']} heads, {tcfg['kv_heads']} "
              f"kv heads, ffn {tcfg['ffn']}, {tcfg['layers']} layers, batch {tcfg['batch']}, LoRA r="
              f"{tcfg['lora_rank']} all-linear, {tcfg['repeats']} timed rounds", flush=True)
        results += measure_training(tcfg, args.configs, progress=not args.no_progress)
    print(format_table(results, cfg))
    out = run_dir(args.out, "hf-quick" if args.quick else "hf")
    write_csv(results, out / "results.csv")
    print(f"wrote results.csv to {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
