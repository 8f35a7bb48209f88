"""The Python tax: a converted model's training-step time where the kernels cost nothing, against transformers'.

    python -m selective_ckpt.bench.python_tax                 # Llama, hidden 64, 4 layers, 2 x 32 tokens, 1 thread
    python -m selective_ckpt.bench.python_tax --forms fp32,lora --rounds 30

At this shape a step's time is Python and dispatch: module calls, hooks, per-call checks, what the recompute and
its saved-tensor hooks add. For each training form (fp32; bf16 autocast; autocast with LoRA r=8, dropout 0.05 on
every linear module; QLoRA NF4 with LoRA dropout, as prepared by PEFT) the same model is built twice from one
seed, one converted ("selective"), and their steps (forward with labels, backward, zero_grad) are timed
interleaved: each round times one step of each in turn, so a busy machine slows both alike. Printed per form:
the median step of each, their ratio's median and its p20-p80 spread over rounds. CPU time of the one thread
(time.thread_time) is what is compared; the CPU model is in the header.
"""

import argparse
import contextlib
import platform
import statistics
import sys
import time
import warnings

import torch

from .. import compat
from ..fit.configs import require

FORMS = ("fp32", "autocast", "lora", "qlora")
VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 128, 64, 4, 2, 32


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _base(form, tmp):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=176, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         use_cache=False, tie_word_embeddings=False)
    compat.set_attention_implementation(config, "sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if form == "qlora":
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        model.save_pretrained(tmp)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = LlamaForCausalLM.from_pretrained(tmp, quantization_config=q, attn_implementation="sdpa")
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if form in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear"))
    return model.train()


def _stepper(model, form, ids):
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if form in ("autocast", "lora") else contextlib.nullcontext()

    def step():
        with cast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def measure(form, rounds, tmp):
    """(transformers' median step s, ours, ratio median, ratio p20, ratio p80) for one form."""
    from ..models import convert

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    theirs = _stepper(_base(form, f"{tmp}/theirs"), form, ids)
    ours = _stepper(convert(_base(form, f"{tmp}/ours")), form, ids)
    for step in (theirs, ours, theirs, ours):  # first calls: lazy state, caches
        step()
    times = {"theirs": [], "ours": []}
    for _ in range(rounds):
        for name, step in (("theirs", theirs), ("ours", ours)):
            t0 = time.thread_time()
            step()
            times[name].append(time.thread_time() - t0)
    ratios = sorted(o / t for o, t in zip(times["ours"], times["theirs"]))
    q = statistics.quantiles(ratios, n=5)
    return statistics.median(times["theirs"]), statistics.median(times["ours"]), statistics.median(ratios), q[0], q[-1]


def main(argv=None):
    import tempfile

    p = argparse.ArgumentParser(prog="python -m selective_ckpt.bench.python_tax", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, from {', '.join(FORMS)}")
    p.add_argument("--rounds", type=int, default=20, help="interleaved steps timed per model")
    args = p.parse_args(argv)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    for f in forms:
        if f not in FORMS:
            raise SystemExit(f"--forms: {f!r} is not one of {', '.join(FORMS)}")
    if args.rounds < 5:
        raise SystemExit(f"--rounds must be at least 5 (quantiles of the ratio), got {args.rounds}")
    require("transformers", "peft", what="this benchmark")
    torch.set_num_threads(1)
    print(f"python tax: Llama hidden {HIDDEN}, {LAYERS} layers, {BATCH} x {SEQ} tokens, 1 thread, {args.rounds} "
          f"interleaved rounds; {cpu_model()}; torch {torch.__version__}", flush=True)
    print("| form | transformers ms | converted ms | converted / transformers (p20-p80) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for form in forms:
            theirs, ours, ratio, lo, hi = measure(form, args.rounds, tmp)
            print(f"| {form} | {theirs * 1e3:.2f} | {ours * 1e3:.2f} | {ratio:.2f} ({lo:.2f}-{hi:.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    from ..fit.configs import exit_code

    sys.exit(exit_code(main, "python -m selective_ckpt.bench.python_tax"))
