"""The fit report as text: what the step holds, each variant's peak and longest context, what the model leaves
out, and last the recommendation with the calls that apply it. Every line fits WIDTH columns unless `wide`."""

import textwrap

from ..memory.units import format_bytes
from .arithmetic import ALLOCATOR_SHARE, VARIANTS

WIDTH = 100
NAME = 38  # the longest variant name, "transformers + gradient checkpointing", and a space

# (heading line 1, heading line 2, width) of the columns, and what each means
MEMORY_COLUMNS = (("kept per", "layer", 11), ("kept outside", "layers", 14), ("loss head", "transient", 12),
                  ("layer backward", "transient", 16))
PEAK_COLUMNS = (("allocator", "share", 11), ("", "peak", 12), ("host", "memory", 10))
TIME_COLUMNS = (("step", "seconds", 10), ("tokens", "per second", 12), ("speed vs", "checkpointing", 15))
LEGEND = (
    "kept per layer: the activations one decoder layer keeps for backward",
    "kept outside layers: the activations kept outside the decoder layers (embeddings, the first layer's input)",
    "loss head transient: the most the loss head (logits, loss and their gradients) holds above the kept "
    "activations",
    "layer backward transient: the most one decoder layer's backward holds above what it reads",
    f"allocator share: {ALLOCATOR_SHARE * 100:.0f} % of the peak for the caching allocator's rounding and "
    "fragmentation",
    "ours plan: the planner's (selective_ckpt.plan): per layer what is kept, offloaded to pinned host memory and "
    "rebuilt, and the MLP's or the layer's tiles, at the least predicted step time that fits the GPU and the host "
    "budget; its longest context is the longest some plan fits (one token more, none does)",
    "transformers + gradient checkpointing: transformers' activation checkpointing (Trainer's "
    "activation_checkpointing=True, gradient_checkpointing=True on older transformers)",
    "transformers + offloaded checkpointing: the same with activation_checkpointing_enable(offload=True): each "
    "layer's input copied to pinned host memory and back on the compute stream (torch's save_on_cpu)",
    "step seconds, tokens per second: the time model's prediction (fit.timing: each part's FLOPs and bytes over "
    "the device's rates, copies hidden under compute up to 90 %); speed vs checkpointing: tokens/s over "
    "transformers + gradient checkpointing's",
    "ours attention-kept: each layer keeps its input and attention's output and logsumexp and rebuilds the rest "
    "in backward, never attention itself (keeping.policy(\"attention-kept\"))",
    "inputs offloaded: each layer's input is copied to pinned host memory while the next layer computes and back "
    "before its backward (keeping.policy(mode, offload=[\"input\"])); host memory: those copies, every layer's "
    "but the last",
)


def report(result, wide=False):
    """Text of a Fit: parts, one row per variant in two tables (one with `wide`), what the model does not
    cover, and the recommendation with the calls that apply it."""
    r = result
    out = _wrap([f"model type {r.model_type}, {r.num_layers} layers; GPU {format_bytes(r.gpu_bytes)} "
                 f"({r.gpu_bytes} bytes)", f"{r.form}",
                 f"batch {r.batch}, context {r.seq_len} tokens per sample{_why_context(r)}"], wide)
    if r.source != "simulated":
        out += _wrap([f"(the figures at context {r.seq_len} are {r.source})"], wide)
    out += ["", "what the step holds besides activations:"]
    for k, v in r.parts.items():
        out.append(f"  {k + (' (AdamW)' if k == 'optimizer state' else ''):<28}{format_bytes(v):>12}")
    rows = [(name, r.variants[name]) for name in VARIANTS if name in r.variants]
    out += [""] + _wrap([f"per variant at context {r.seq_len} (peak: the parts above, kept activations, transients, "
                         f"allocator share):"], wide)
    if wide:
        out += _table(r, rows, MEMORY_COLUMNS + PEAK_COLUMNS, peak=True)
    else:
        out += _table(r, rows, MEMORY_COLUMNS, peak=False)
        out += [""] + _table(r, rows, PEAK_COLUMNS, peak=True)
    if r.rates is not None and any(v.step_seconds for _, v in rows):
        out += [""] + _wrap([f"predicted time per step at context {r.seq_len}, batch {r.batch} (rates: "
                             f"{r.rates.device}; {r.rates.source}):"], wide)
        out += _time_table(r, rows)
    errors = {}
    for name, v in rows:
        if v.error is not None:
            errors.setdefault((v.error, v.unfit), []).append(name)
    out += _wrap([f"{', '.join(names)}: {'' if unfit else 'not modelled: '}{error}"
                  for (error, unfit), names in errors.items()], wide)
    if r.plan is not None:
        out += [""] + _wrap([f"the plan: {r.plan.describe()}" + (f", offload prefetch {r.plan.prefetch}" if
                                                                 r.plan.host_bytes else "")], wide)
    out += ["", "columns:"] + _wrap([f"- {x}" for x in LEGEND], wide, indent="  ")
    out += ["", "not modelled:"] + _wrap([f"- {x}" for x in r.not_modelled], wide, indent="  ")
    out += [""] + _wrap(recommendation(r), wide)
    return "\n".join(out)


def _why_context(r):
    if r.seq_len_asked != "max":
        return ""
    if r.max_context.get("ours plan"):
        return " (--seq-len max: the longest the plan fits)"
    return " (--seq-len max: the longest any variant fits)" if any(r.max_context.values()) else \
        " (--seq-len max: no variant fits a single token)"


def _table(r, rows, columns, peak):
    """A table of `columns` (MEMORY_COLUMNS or PEAK_COLUMNS and the fit columns) with a two-line heading."""
    head1 = f"  {'':<{NAME}}" + "".join(f"{a:>{w}}" for a, _, w in columns)
    head2 = f"  {'variant':<{NAME}}" + "".join(f"{b:>{w}}" for _, b, w in columns) + \
        ("  fits  longest context" if peak else "")
    lines = [head1.rstrip(), head2]
    for name, v in rows:
        if v.error is not None:
            lines.append(f"  {name:<{NAME}}{'does not fit' if v.unfit else 'not modelled'} (below)")
            continue
        share = int(v.peak * ALLOCATOR_SHARE)
        cells = {"kept per": v.kept_per_layer, "kept outside": v.kept_outside, "loss head": v.head_transient,
                 "layer backward": v.layer_transient, "allocator": share, "": v.peak + share, "host": v.host}
        line = f"  {name:<{NAME}}" + "".join(
            f"{'-' if a == 'host' and not cells[a] else format_bytes(cells[a]):>{w}}" for a, _, w in columns)
        if peak:
            line += f"  {'yes ' if r.fits(name) else 'no  '}  {r.max_context.get(name, '-')}"
        lines.append(line)
    return lines


def _time_table(r, rows):
    base = r.variants.get("transformers + gradient checkpointing")
    base = base.tokens_per_second if base is not None and base.error is None else None
    head1 = f"  {'':<{NAME}}" + "".join(f"{a:>{w}}" for a, _, w in TIME_COLUMNS)
    head2 = f"  {'variant':<{NAME}}" + "".join(f"{b:>{w}}" for _, b, w in TIME_COLUMNS) + "  fits"
    lines = [head1.rstrip(), head2]
    for name, v in rows:
        if v.error is not None or v.step_seconds is None:
            continue
        speed = f"{v.tokens_per_second / base:.2f}x" if base else "-"
        lines.append(f"  {name:<{NAME}}{v.step_seconds:>10.3f}{v.tokens_per_second:>12,.0f}{speed:>15}  "
                     f"{'yes' if r.fits(name) else 'no'}")
    return lines


def _gib_text(n):
    return f"{n / 2 ** 30:.1f}GiB"


def recommendation(r):
    """Lines: the variant with the least recompute that fits at the report's context, and the calls that apply
    it (convert / set_recompute, the Trainer flags it implies); or, where none fits, the way out."""
    at = f"at context {r.seq_len}, batch {r.batch}"
    plan = r.variants.get("ours plan")
    peft = "  # before or after get_peft_model" if r.form.kind != "full" else ""
    if plan is not None and plan.error is None and r.fits("ours plan"):
        p = r.plan
        autocast = "" if r.form.autocast is None else f", autocast=torch.{str(r.form.autocast).split('.')[-1]}"
        host = "" if r.host_bytes is None else f", host=\"{_gib_text(r.host_bytes)}\""
        lines = [f"recommendation {at}: ours plan, {p.describe()} (peak {_with_share(plan.peak)} of "
                 f"{format_bytes(r.gpu_bytes)}" + (f", {format_bytes(plan.host)} pinned host memory" if plan.host
                                                   else "") + f"; {plan.tokens_per_second:,.0f} tokens/s predicted)",
                 f"  model = selective_ckpt.convert(model){peft}",
                 f"  plan = selective_ckpt.plan(model, gpu=\"{_gib_text(r.gpu_bytes)}\"{host}, batch={r.batch}, "
                 f"seq_len={r.seq_len}{autocast})",
                 "  selective_ckpt.set_recompute(model, plan)  # print(plan): what each layer keeps, offloads, "
                 "rebuilds"]
        if r.form.kind == "qlora":  # peft's default turns transformers' checkpointing on
            lines.insert(1, "  model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)")
        return lines + [f"  Trainer or TRL's SFTConfig: activation_checkpointing=False{_precision(r.form)}",
                        "  (gradient_checkpointing=False on older transformers; SFTConfig turns it on by default, and "
                        "under it every converted layer runs \"full\")"]
    for name in ("transformers", "transformers + gradient checkpointing"):
        v = r.variants.get(name)
        if v is not None and v.error is None and r.fits(name):
            on = "checkpointing" in name
            return [f"recommendation {at}: {name} (peak {_with_share(v.peak)} of {format_bytes(r.gpu_bytes)})",
                    f"  Trainer or TRL's SFTConfig: activation_checkpointing={on}{_precision(r.form)}",
                    f"  (gradient_checkpointing={on} on older transformers)"]
    best = max(r.max_context, key=r.max_context.get) if r.max_context else None
    if best is not None and r.max_context[best]:
        return [f"nothing fits {at}: the longest context that fits is {r.max_context[best]} ({best}); try "
                f"--seq-len {r.max_context[best]}, a smaller --batch or a lighter --form"]
    return [f"nothing fits {at}, not even one token per sample: try a lighter --form (lora, qlora) or a larger GPU"]


def _precision(form):
    import torch

    if form.autocast is None or form.weights != torch.float32:
        return ""
    return f", {'bf16' if form.autocast == torch.bfloat16 else 'fp16'}=True"


def _with_share(peak):
    return format_bytes(peak * (1 + ALLOCATOR_SHARE))


def _wrap(lines, wide, indent=""):
    """Lines wrapped to WIDTH (continuations indented two more than `indent`), unless `wide`."""
    if wide:
        return [indent + x for x in lines]
    out = []
    for x in lines:
        out += textwrap.wrap(x, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                             break_on_hyphens=False, break_long_words=False) or [""]
    return out


def frontier(r, contexts):
    """A markdown table: per context, each variant's predicted tokens/s ('-' where it does not fit the GPU and the
    host budget), then the plan's GPU peak, pinned host memory and policies."""
    from .fitting import plan_at

    names = [n for n in VARIANTS if n != "ours plan"]
    lines = [f"tokens/s predicted (rates: {r.rates.device}) at each context; '-': does not fit "
             f"{format_bytes(r.gpu_bytes)} of GPU" + (f" and {format_bytes(r.host_bytes)} of pinned host memory"
                                                      if r.host_bytes is not None else ""),
             "", "| context | " + " | ".join(names) + " | ours plan | plan: GPU peak, host | plan |",
             "|---" * (len(names) + 4) + "|"]
    for s in contexts:
        cells = []
        for name in names:
            v = r.at(name, s)
            cells.append(f"{v.tokens_per_second:,.0f}" if r.fits_at(name, s) and v.tokens_per_second else "-")
        p, v = plan_at(r._projection, s, r.gpu_bytes, r.host_bytes, r.rates)
        if p is None:
            cells += ["-", "-", "no plan fits"]
        else:
            cells += [f"{p.tokens_per_second:,.0f}",
                      f"{_with_share(p.peak)}, {format_bytes(p.host_bytes) if p.host_bytes else 'no host'}",
                      p.describe()]
        lines.append(f"| {s:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
