"""Fine-tune a tiny Llama with PEFT LoRA (or QLoRA) under Hugging Face's Trainer with bf16=True, with and
without selective_ckpt, on CPU.

The model is built from a config in code (nothing is downloaded) and reads bytes (vocabulary 256)
of text the repository carries: the Zen of Python and README.md. The same run is made twice from
the same seeds: once as transformers builds it (SDPA attention), once converted by the one line

    model = selective_ckpt.convert(model)

It trains as people fine-tune: fp32 weights under Trainer's `bf16=True` (autocast), LoRA with
lora_dropout=0.05 on every Linear; `--qlora` loads the base in 4-bit NF4 (bitsandbytes, which runs
on CPU) after peft's prepare_model_for_kbit_training. It prints both loss curves and the activation
bytes each decoder layer keeps for backward (profiler allocation deltas of one training forward
under the same autocast, all layers minus one layer), next to the floor for the layer in that
configuration (models.configuration.layer_estimate: its shape, dtypes and LoRA rank terms).

    python examples/finetune_llama_lora.py               # 40 steps each
    python examples/finetune_llama_lora.py --qlora       # 4-bit base (needs the [hf] extra's bitsandbytes)
    python examples/finetune_llama_lora.py --fp32        # no autocast
    python examples/finetune_llama_lora.py --steps 3     # a quick check
"""

import argparse
import codecs
import contextlib
import importlib.util
import io
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent  # the text to train on; the package comes from the install

import selective_ckpt  # noqa: E402
from selective_ckpt import memory  # noqa: E402


def load_bytes():
    with contextlib.redirect_stdout(io.StringIO()):  # importing it prints the Zen
        import this  # the Zen of Python ships rot13-encoded
    text = codecs.decode(this.s, "rot13") + "\n"
    readme = ROOT / "README.md"
    if readme.is_file():
        text += readme.read_text(errors="ignore")
    return torch.tensor(list(text.encode()), dtype=torch.long)


class Chunks(torch.utils.data.Dataset):
    """Fixed-length windows of the byte stream; labels are the inputs (the model shifts them)."""

    def __init__(self, data, seq, count, seed):
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - seq, (count,), generator=g).tolist()
        self.data, self.seq = data, seq

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        ids = self.data[self.starts[i]:self.starts[i] + self.seq]
        return {"input_ids": ids, "labels": ids}


def build(args, converted):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq, use_cache=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    if args.qlora:
        model = quantized(model)
    if converted:
        model = selective_ckpt.convert(model)  # the one line
    torch.manual_seed(args.seed + 1)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=args.lora_dropout, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def quantized(model):
    """The model reloaded with a 4-bit NF4 base (bf16 compute) and prepared for k-bit training (fp32 norms)."""
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = LlamaForCausalLM.from_pretrained(path, quantization_config=q, attn_implementation="sdpa")
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def autocast(args):
    return torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()


@contextlib.contextmanager
def _layers_run(model, n):
    """Runs only the first n decoder layers (LlamaModel iterates layers[:config.num_hidden_layers])."""
    config = model.get_base_model().config
    saved = config.num_hidden_layers
    config.num_hidden_layers = n
    try:
        yield
    finally:
        config.num_hidden_layers = saved


def kept_bytes_per_layer(model, batch, args):
    """Bytes one decoder layer keeps alive for backward after a training forward: (all layers - one) / (L - 1)."""
    layers = model.get_base_model().config.num_hidden_layers
    kept = []
    model.train()
    with autocast(args):  # first calls change state once (bnb casts biases, lazy buffers): not measured
        model(**batch)
    for n in (1, layers):
        with _layers_run(model, n):
            held = []

            def forward(h=held):
                with autocast(args):
                    h.append(model(**batch).loss)
            kept.append(sum(memory.cpu_allocation_deltas(forward)))
            del held
    return (kept[1] - kept[0]) // (layers - 1)


def checkpointing_off(arguments):
    """transformers' activation checkpointing off, as a converted model trains (under it every converted layer
    would run "full"): activation_checkpointing=False, gradient_checkpointing=False where transformers predates
    the name. Off is Trainer's default; TRL's SFTConfig turns it on."""
    fields = getattr(arguments, "__dataclass_fields__", {})
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": False}


def train(args, data, converted):
    from transformers import Trainer, TrainingArguments

    model = build(args, converted)
    probe = torch.utils.data.default_collate([Chunks(data, args.seq, args.batch, args.seed + 7)[i]
                                              for i in range(args.batch)])
    per_layer = kept_bytes_per_layer(model, probe, args)
    floor = None
    if converted:
        from selective_ckpt.models.configuration import layer_estimate

        layer = selective_ckpt.recomputable_layers(model)[-1]
        floor = layer_estimate(layer, args.seq, args.batch, torch.bfloat16 if args.bf16 else None)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                                  learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                  dataloader_num_workers=0, seed=args.seed, disable_tqdm=True, bf16=args.bf16,
                                  **checkpointing_off(TrainingArguments))
        trainer = Trainer(model=model, args=targs, train_dataset=Chunks(data, args.seq, args.steps * args.batch,
                                                                       args.seed))
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    runtime = next(e["train_runtime"] for e in trainer.state.log_history if "train_runtime" in e)
    return losses, per_layer, runtime, floor


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    ap.add_argument("--qlora", action="store_true", help="4-bit NF4 base after prepare_model_for_kbit_training")
    ap.add_argument("--fp32", dest="bf16", action="store_false", help="no autocast (Trainer's bf16=False)")
    args = ap.parse_args(argv)
    for package in ("transformers", "peft") + (("bitsandbytes",) if args.qlora else ()):
        if importlib.util.find_spec(package) is None:
            ap.exit(1, f"{ap.prog}: error: this example needs {package}, which is not installed: "
                       f"pip install \"selective_ckpt[hf]\"\n")
    if args.layers < 2:
        ap.error("--layers must be at least 2 (bytes per layer are all layers minus one)")

    # PEFT still reads the deprecated name of transformers' `is_activation_checkpointing` (a FutureWarning per
    # model); nothing in this script uses the old name
    warnings.filterwarnings("ignore", message=".*Use `is_activation_checkpointing` instead", category=FutureWarning)
    data = load_bytes()
    print(f"text: {len(data)} bytes; Llama: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
          f"{args.heads} heads / {args.kv_heads} kv heads; {'QLoRA (4-bit NF4 base)' if args.qlora else 'LoRA'} "
          f"r=8, dropout {args.lora_dropout} on every Linear; Trainer bf16={args.bf16}; batch {args.batch} x seq "
          f"{args.seq}")
    results = {}
    for name, converted in (("transformers (SDPA)", False), ("selective_ckpt", True)):
        print(f"training: {name}", flush=True)
        results[name] = train(args, data, converted)

    floor = results["selective_ckpt"][3]
    print("\nstep  " + "  ".join(f"{n:>20s}" for n in results))
    curves = [r[0] for r in results.values()]
    for step in range(len(curves[0])):
        if step < 5 or step % 10 == 0 or step == len(curves[0]) - 1:
            print(f"{step + 1:4d}  " + "  ".join(f"{c[step]:20.4f}" for c in curves))
    gap = max(abs(a - b) for a, b in zip(*curves))
    print(f"largest loss difference between the two runs: {gap:.2e} (rounding of different kernels; LoRA "
          "dropout masks differ: ours are drawn by seed)")
    print("\nactivation bytes kept per decoder layer (one training forward):")
    for name, (_, per_layer, runtime, _) in results.items():
        print(f"  {name:20s} {memory.format_bytes(per_layer):>10s}  ({per_layer / (args.batch * args.seq):7.1f} "
              f"B/token)  train {runtime:.1f} s")
    tokens = args.batch * args.seq
    print(f"  {'floor (estimate)':20s} {memory.format_bytes(floor):>10s}  ({floor / tokens:7.1f} B/token: the "
          "layer's floor in this configuration, LoRA's rank terms included)")
    return 0


if __name__ == "__main__":
    if "--qlora" not in sys.argv:  # only --qlora needs bitsandbytes; peft imports it where installed, and on a CPU
        sys.modules.setdefault("bitsandbytes", None)  # without its kernels package that import prints a warning
    sys.exit(main())
