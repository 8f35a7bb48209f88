"""A real training step's peak against selective_ckpt.fit's prediction, at a model's full size, on any device.

    python -m selective_ckpt.bench.fit_check Llama-3.1-8B --device cuda --seq-len 8192 --form lora --rank 16 \\
        --autocast bfloat16                       # the projected table's first rows, measured on a GPU
    python -m selective_ckpt.bench.fit_check Llama-3.1-8B --layers 2 --hidden 256 --seq-len 256   # CPU, small

For each variant the model is built on the device with random weights (the config's sizes; --layers and
--hidden shrink it), put in the training form, then run as Trainer runs it: a first step (AdamW's state), a
second whose peak is measured, and --timed more for the step time. The peak is weights + optimizer state +
the step's transients: torch.cuda.max_memory_allocated over the second step on CUDA (max_memory_reserved
beside it: what the caching allocator took from the driver), the allocator events' running peak on CPU.
Beside it, fit's predicted peak (simulated on fake CPU tensors) and their ratio; the predicted peak with the
fit's allocator share (5 %) is what it compares with a GPU's memory. The measured step is one sample and
its time the median of the timed steps: no spread over processes.
"""

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time

import torch

QLORA_REFUSED = ("form: qlora is not measured here (a 4-bit base needs bitsandbytes' CUDA build); "
                 "tests/fit/test_fit.py measures it on CPU")
VARIANTS = ("transformers", "ours selective", "transformers + gradient checkpointing", "ours full")
_GIB = 2 ** 30


def _config(name, layers=None, hidden=None):
    from ..fit import load_config

    config = load_config(name)
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types)[:layers]
    if hidden is not None:  # the same head count and ffn ratio at width `hidden`
        ratio = config.intermediate_size / config.hidden_size
        config.head_dim = hidden // config.num_attention_heads
        config.hidden_size, config.intermediate_size = hidden, int(round(ratio * hidden))
    return config


def build(config, form, variant, device):
    """transformers' causal LM of `config` on `device` in `form` (LoRA from PEFT as fit builds it), then as
    `variant` trains it: as built, under gradient checkpointing, or converted in a recompute mode."""
    from transformers import AutoModelForCausalLM

    from ..fit.simulate import checkpointing, with_lora
    from ..models import convert

    if form.kind == "qlora":
        raise ValueError(QLORA_REFUSED)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=form.weights)
    if form.kind == "lora":
        model = with_lora(model, form)
    model.train()
    if variant == "transformers + gradient checkpointing":
        checkpointing(model, True)
    elif variant.startswith("ours "):
        convert(model, recompute=variant.split()[1])
    elif variant != "transformers":
        raise ValueError(f"variants: {variant!r} is not one of {', '.join(VARIANTS)}")
    return model


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config, form, variant, device, batch, seq_len, timed=2):
    """{peak, reserved, step_s, loss} of `variant`'s second step (peak and reserved in bytes)."""
    from ..memory import cpu_allocation_deltas, running_peak

    model = build(config, form, variant, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(1, config.vocab_size, (batch, seq_len), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    cast = torch.autocast(device.type, dtype=form.autocast) if form.autocast else contextlib.nullcontext()
    losses = []

    def step():
        with cast:  # forward and loss under autocast, backward and the optimizer step outside, as Trainer
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    step()
    gc.collect()
    _sync(device)
    out = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        out["peak"] = torch.cuda.max_memory_allocated(device)
        out["reserved"] = torch.cuda.max_memory_reserved(device)
    else:
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        held += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        out["peak"] = held + running_peak(cpu_allocation_deltas(step))
        out["reserved"] = None
    times = []
    for _ in range(timed):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times) if times else None
    out["loss"] = losses[-1]
    return out  # the model and its optimizer go with this frame; the caller empties the cache


def _release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _gib(n):
    return "-" if n is None else f"{n / _GIB:.2f}"


def build_parser():
    from ..fit.__main__ import add_form_arguments

    p = argparse.ArgumentParser(prog="python -m selective_ckpt.bench.fit_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a bundled config's name or a config.json path")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--hidden", type=int, default=None, help="override the width (heads and ffn ratio kept)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from: {', '.join(VARIANTS)}")
    p.add_argument("--timed", type=int, default=2, help="steps timed after the measured one")
    p.add_argument("--no-predict", action="store_true", help="measure only (no fit simulation)")
    p.add_argument("--json", default=None, help="write the rows to this file as well")
    add_form_arguments(p)
    return p


def main(argv=None):
    from ..fit.__main__ import form_from_arguments
    from ..fit.arithmetic import ALLOCATOR_SHARE
    from ..fit.fitting import predict

    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    try:
        form = form_from_arguments(args)
    except (ValueError, TypeError) as err:
        raise SystemExit(f"error: {err}") from None
    if form.kind == "qlora":  # refused before any variant is built
        raise SystemExit(f"error: {QLORA_REFUSED}")
    config = _config(args.config, args.layers, args.hidden)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{args.config}: {config.num_hidden_layers} layers, hidden {config.hidden_size}; {form}; batch "
          f"{args.batch} x {args.seq_len}; {where}; torch {torch.__version__}", flush=True)
    predicted = {}
    if not args.no_predict:
        t0 = time.perf_counter()
        predicted = {n: v.peak for n, v in predict(config, args.batch, args.seq_len, form, names=variants).items()}
        print(f"predicted in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    print("| variant | measured peak GiB | reserved GiB | predicted GiB | predicted / measured | "
          f"predicted x {1 + ALLOCATOR_SHARE:.2f} / reserved | step s | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        try:
            got = measure(config, form, v, device, args.batch, args.seq_len, args.timed)
        except Exception as err:  # one variant's failure (out of memory, say) leaves the others' rows
            print(f"| {v} | failed: {type(err).__name__}: {str(err)[:300]} |", flush=True)
            rows.append({"variant": v, "error": f"{type(err).__name__}: {err}"})
            continue
        finally:
            _release(device)
        pred = predicted.get(v)
        ratio = f"{pred / got['peak']:.3f}" if pred else "-"
        share = f"{pred * (1 + ALLOCATOR_SHARE) / got['reserved']:.3f}" if pred and got["reserved"] else "-"
        step = "-" if got["step_s"] is None else f"{got['step_s']:.3f}"
        print(f"| {v} | {_gib(got['peak'])} | {_gib(got['reserved'])} | {_gib(pred)} | {ratio} | {share} | "
              f"{step} | {got['loss']:.4f} |", flush=True)
        rows.append({"variant": v, "predicted": pred, **got})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "device": where, "batch": args.batch, "seq_len": args.seq_len,
                       "form": str(form), "layers": config.num_hidden_layers, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    from ..fit.configs import exit_code

    sys.exit(exit_code(main, "python -m selective_ckpt.bench.fit_check"))
