"""The fit report as text: the step's parts, each variant's peak and phases, the longest context that fits."""

from ..memory.units import format_bytes
from .arithmetic import ALLOCATOR_SHARE, VARIANTS


def report(result):
    """Text of a Fit: parts, one row per variant, and what the model does not cover."""
    r = result
    lines = [f"model type {r.model_type}, {r.num_layers} layers; {r.form}; batch {r.batch}, context {r.seq_len}; "
             f"GPU {format_bytes(r.gpu_bytes)}",
             "", "step parts (bytes):"]
    for k, v in r.parts.items():
        lines.append(f"  {k:<28}{format_bytes(v):>12}")
    head = (f"  {'variant':<40}{'kept/layer':>12}{'outside':>12}{'head tr.':>12}{'layer bwd tr.':>14}"
            f"{'allocator':>12}{'peak':>12}  fits  longest context")
    lines += ["", f"per variant at context {r.seq_len} (peak = parts + activations + transients + "
              f"{ALLOCATOR_SHARE:.0%} allocator share):", head]
    for name in VARIANTS:
        v = r.variants.get(name)
        if v is None:
            continue
        longest = r.max_context.get(name, "-")
        if v.error is not None:
            lines.append(f"  {name:<40}not modelled: {v.error}")
            continue
        share = int(v.peak * ALLOCATOR_SHARE)
        lines.append(f"  {name:<40}{format_bytes(v.kept_per_layer):>12}{format_bytes(v.kept_outside):>12}"
                     f"{format_bytes(v.head_transient):>12}{format_bytes(v.layer_transient):>14}"
                     f"{format_bytes(share):>12}{format_bytes(v.peak + share):>12}  "
                     f"{'yes ' if r.fits(name) else 'no  '}  {longest}")
        if v.modes:
            counts = {m: v.modes.count(m) for m in dict.fromkeys(v.modes)}
            lines.append(f"  {'':<40}plan: " + ", ".join(f"{n} x {m}" for m, n in counts.items()))
    lines += ["", "not modelled:"] + [f"  - {x}" for x in r.not_modelled]
    return "\n".join(lines)
