"""Keep, offload or rebuild: a real training step's peak, host bytes and time under each layer policy.

    python -m selective_ckpt.bench.offload Llama-3.1-8B --device cuda --seq-len 8192,16384,32768 --form lora \\
        --rank 16 --autocast bfloat16            # bench/gpu.sh's offload step
    python -m selective_ckpt.bench.offload Llama-3.1-8B --device cuda --gpu 80GiB --host 256GB --seq-len 16K,32K \\
        --policies "plan;transformers + gradient checkpointing;transformers + offloaded checkpointing;full, offload \\
        input" --predict ...                     # the planner against what it predicts (bench/gpu.sh's plan step)
    python -m selective_ckpt.bench.offload Llama-3.1-8B --layers 2 --hidden 128 --seq-len 64   # CPU, small

"plan" is selective_ckpt.plan's for --gpu and --host at each context (with the rates of --rates, else the
device's probed ones); the transformers rows run the unconverted model as it trains by default ("transformers")
and under its activation checkpointing (with offload=True for the offloaded one). --gpu on CUDA also caps the process at that much memory
(torch.cuda.set_per_process_memory_fraction), so an 80 GB card is emulated on a larger one. --predict adds the
fit's predicted peak and step time of each row (its variant, or the plan's own) and their ratios to the measured.

The model is built at the config's size with random weights (--layers and --hidden shrink it), converted with
each policy, and run as Trainer runs it (a first step for AdamW's state, a measured one, then --timed more).
Per row: the allocated peak of the measured step (torch.cuda.max_memory_allocated; the allocator events'
running peak on CPU), the host bytes the offload engine held at most, the bytes it copied each way, and the
median step time. The first lines give the host link's measured rate each way (pinned memory, 1 GiB on CUDA).
"""

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from ..keeping import CLASSES, policy

_KEPT_BY_SELECTIVE = tuple(c for c in CLASSES if c != "norm_act")
POLICIES = {
    "selective": policy("selective"),
    "selective, offload mlp": policy("selective", offload=["mlp"]),
    "selective, offload all": policy("selective", offload=_KEPT_BY_SELECTIVE),
    "full": policy("full"),
    "full, offload input": policy("full", offload=["input"]),
    "attention-kept": policy("attention-kept"),
    "attention-kept, offload input": policy("attention-kept", offload=["input"]),
    "full, offload input, layer in 16 tiles": policy("full", offload=["input"], layer_tiles=16),
}
_GIB = 2 ** 30
# rows that are no policy of ours: the planner's plan, and transformers' model as it trains by default and under its
# own checkpointing
PLAN = "plan"
TRANSFORMERS = ("transformers", "transformers + gradient checkpointing", "transformers + offloaded checkpointing")
# the fit variant whose prediction a policy row is compared with
_FIT_VARIANTS = {"selective": "ours selective", "full": "ours full",
                 "full, offload input": "ours full, inputs offloaded",
                 "attention-kept": "ours attention-kept",
                 "attention-kept, offload input": "ours attention-kept, inputs offloaded",
                 **{t: t for t in TRANSFORMERS}}


def link_rates(device, nbytes=_GIB):
    """(D2H, H2D) bytes per second of a pinned copy of `nbytes` (the median of three each way)."""
    if device.type != "cuda":
        return None, None
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        rates.append(nbytes / statistics.median(times))
    del dev, host
    return tuple(rates)


def measure(config, form, name, device, batch, seq_len, timed=1):
    """{peak, host_peak, d2h, h2d, step_s, loss} of the policy `name`'s measured step."""
    from ..layers import set_recompute
    from ..memory import cpu_allocation_deltas, running_peak
    from ..models import convert
    from ..registry import recomputable_layers, state_of
    from .fit_check import build

    if name in TRANSFORMERS:
        model = build(config, form, "transformers", device)
        root = model.get_base_model() if hasattr(model, "get_base_model") else model
        if name != "transformers":
            root.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                                 offload="offloaded" in name)
        engine = None
    else:
        model = convert(build(config, form, "transformers", device), recompute="selective")
        set_recompute(model, POLICIES[name] if isinstance(name, str) else name)
        engine = state_of(recomputable_layers(model)[0]).engine
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(1, config.vocab_size, (batch, seq_len), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    losses = []

    def step():
        with torch.autocast(device.type, dtype=form.autocast, enabled=form.autocast is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    step()
    gc.collect()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    out = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        out["peak"] = torch.cuda.max_memory_allocated(device)
    else:
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        held += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        out["peak"] = held + running_peak(cpu_allocation_deltas(step))
    times = []
    for _ in range(timed):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    stats = engine.stats() if engine is not None else {}
    out.update(host_peak=stats.get("host_peak", 0), d2h=stats.get("d2h_bytes", 0), h2d=stats.get("h2d_bytes", 0),
               step_s=statistics.median(times) if times else None, loss=losses[-1])
    if engine is not None:
        engine.close()
    return out


def _gib(n):
    return "-" if n is None else f"{n / _GIB:.2f}"


def build_parser():
    from ..fit.__main__ import add_form_arguments

    p = argparse.ArgumentParser(prog="python -m selective_ckpt.bench.offload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a bundled config's name or a config.json path")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", default="8192", help="comma-separated tokens per sample")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--hidden", type=int, default=None, help="override the width (heads and ffn ratio kept)")
    p.add_argument("--policies", default=list(POLICIES), help=f"';'-separated, from: {'; '.join(POLICIES)}",
                   type=lambda s: [v.strip() for v in s.split(";") if v.strip()])
    p.add_argument("--timed", type=int, default=1, help="steps timed after the measured one")
    p.add_argument("--gpu", default=None, help="GPU memory the plan is made for (80GiB, H100-80GB); on CUDA the "
                                                "process is capped at it")
    p.add_argument("--host", default="256GB", help="pinned host memory the plan may use (default: %(default)s)")
    p.add_argument("--rates", default=None, help="the card whose rates the plan and predictions use (default: the "
                                                  "device's, probed)")
    p.add_argument("--predict", action="store_true", help="add the fit's predicted peak and step time per row")
    p.add_argument("--json", default=None, help="write the rows to this file as well")
    add_form_arguments(p)
    return p


def main(argv=None):
    from ..fit.__main__ import form_from_arguments
    from .fit_check import _config, _release

    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    try:
        form = form_from_arguments(args)
        from ..fit.__main__ import parse_seq_len

        lengths = [parse_seq_len(s) for s in args.seq_len.split(",") if s.strip()]
    except (ValueError, TypeError) as err:
        raise SystemExit(f"error: {err}") from None
    for name in args.policies:
        if name not in POLICIES and name != PLAN and name not in TRANSFORMERS:
            raise SystemExit(f"--policies: {name!r} is not one of {'; '.join((*POLICIES, PLAN, *TRANSFORMERS))}")
    if PLAN in args.policies and args.gpu is None:
        raise SystemExit("--policies plan needs --gpu (the memory the plan is made for)")
    if form.kind == "qlora" and (PLAN in args.policies or args.predict):
        raise SystemExit("--form qlora: the bench builds random-weight models and cannot quantize them")
    config = _config(args.config, args.layers, args.hidden)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{args.config}: {config.num_hidden_layers} layers, hidden {config.hidden_size}; {form}; batch "
          f"{args.batch}; {where}; torch {torch.__version__}", flush=True)
    d2h, h2d = link_rates(device)
    if d2h:
        print(f"host link, pinned: D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s", flush=True)
    gpu = host = rates = None
    if args.gpu is not None or args.predict:
        from ..fit import probe, rates_for
        from ..fit.cards import parse_bytes

        gpu = parse_bytes(args.gpu) if args.gpu else None
        host = parse_bytes(args.host, "--host")
        rates = rates_for(args.rates) if args.rates else probe(device)
        print(f"rates: {rates.device} ({rates.source})", flush=True)
        if gpu is not None and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, gpu / total), device)
            print(f"GPU capped at {gpu / _GIB:.2f} GiB of {total / _GIB:.2f}", flush=True)
    rows = []
    extra = " predicted peak GiB | peak pred/meas | predicted step s | step pred/meas |" if args.predict else ""
    print("| tokens | policy | peak GiB | host GiB | copied out GiB | step s | vs selective | tokens/s | loss |" +
          extra)
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * (4 if args.predict else 0))
    for seq_len in lengths:
        base = None
        for name in args.policies:
            predicted = None
            try:
                run_as = name
                if name == PLAN:
                    from .. import plan as make_plan

                    planned = make_plan(config, gpu=gpu, host=host, batch=args.batch, seq_len=seq_len, form=form,
                                        rates=rates)
                    print(f"plan at {seq_len}: {planned.describe()}", flush=True)
                    run_as, predicted = planned, (planned.peak, planned.step_seconds)
                elif args.predict and name in _FIT_VARIANTS:
                    from ..fit import predict

                    v = predict(config, args.batch, seq_len, form, names=(_FIT_VARIANTS[name],),
                                rates=rates)[_FIT_VARIANTS[name]]
                    predicted = (v.peak, v.step_seconds)
                got = measure(config, form, run_as, device, args.batch, seq_len, args.timed)
            except Exception as err:  # one row's failure (out of memory, say) leaves the others
                print(f"| {seq_len} | {name} | failed: {type(err).__name__}: {str(err)[:200]} |", flush=True)
                rows.append({"seq_len": seq_len, "policy": name, "error": f"{type(err).__name__}: {err}"})
                continue
            finally:
                _release(device)
            if name == "selective":
                base = got["step_s"]
            ratio = f"{got['step_s'] / base:.3f}" if base and got["step_s"] else "-"
            step = "-" if got["step_s"] is None else f"{got['step_s']:.3f}"
            speed = "-" if not got["step_s"] else f"{args.batch * seq_len / got['step_s']:,.0f}"
            line = (f"| {seq_len} | {name} | {_gib(got['peak'])} | {_gib(got['host_peak'])} | {_gib(got['d2h'])} | "
                    f"{step} | {ratio} | {speed} | {got['loss']:.4f} |")
            if args.predict:
                if predicted is None:
                    line += " - | - | - | - |"
                else:
                    got["predicted_peak"], got["predicted_step_s"] = predicted
                    line += (f" {_gib(predicted[0])} | {predicted[0] / got['peak']:.3f} | {predicted[1]:.3f} | " +
                             (f"{predicted[1] / got['step_s']:.3f} |" if got["step_s"] else "- |"))
            print(line, flush=True)
            rows.append({"seq_len": seq_len, "policy": name if isinstance(name, str) else str(name), **got})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "device": where, "batch": args.batch, "form": str(form),
                       "layers": config.num_hidden_layers, "d2h_rate": d2h, "h2d_rate": h2d, "rows": rows}, f,
                      indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    from ..fit.configs import exit_code

    sys.exit(exit_code(main, "python -m selective_ckpt.bench.offload"))
