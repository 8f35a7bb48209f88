"""The step's peak, by part, for any number of layers and any context, from simulated 1- and 2-layer steps.

Each variant (transformers' model as it trains by default, with gradient checkpointing, and converted in each
recompute mode) is simulated at full width on fake tensors (simulate.py) with one and with two decoder
layers. What a step holds in each phase, over the weights and the optimizer state, grows with the layer count
in a known way: the forward of layer j holds the kept bytes k of the j layers before it; the head and the loss
hold all L layers' k; the backward of layer j holds the k of the layers below it and the gradients g of the
trained weights above it; the optimizer step holds every gradient. So with a 1-layer step's phases and k and
g from the 2-layer one, a model of L layers (each in its own recompute mode, for a per-layer plan) is

    peak = weights + optimizer state + max(forward of layer j, head, loss backward, backward of layer j,
                                           optimizer step)

Every term is linear in the context as well (fused attention keeps O(S) per layer; ours' loss head works in
chunks of fixed size once there are more tokens than a chunk), so two simulated contexts give the longest
context that fits.
"""

import contextlib
import dataclasses

from ..validation import check_positive_int
from . import simulate
from .forms import TrainingForm

VARIANTS = ("transformers", "transformers + gradient checkpointing", "ours none", "ours selective", "ours full",
            "ours plan")
_SIMULATED = {"transformers": "transformers", "transformers + gradient checkpointing": "checkpointing",
              "ours none": "none", "ours selective": "selective", "ours full": "full"}
ALLOCATOR_SHARE = 0.05  # the caching allocator's rounding and fragmentation, as a share of the peak

NOT_MODELLED = (
    "CUDA context and kernel workspaces (cuBLAS, the fused attention's scratch): outside the caching allocator",
    "the caching allocator's fragmentation beyond a flat 5 % share",
    "mixture-of-experts routing: the routed rows are split evenly between the experts where the split matters (what "
    "each layer keeps does not depend on it, the busiest expert's transients do); the experts run the "
    "implementation the config names, else grouped_mm (from_pretrained's choice where torch has grouped matmuls)",
    "data-loader, pinned and host memory; distributed (ZeRO/FSDP) sharding",
    "the step is simulated with PyTorch's CPU kernels: attention keeps what CPU SDPA's fused kernel keeps (q, k, "
    "v, output, logsumexp, the mask when there is one), as the GPU's flash and memory-efficient kernels do",
    "QLoRA bases are NF4 with one float32 absmax per 64 weights and bf16 compute (no double quantization)",
    "gradient checkpointing is transformers' with torch.utils.checkpoint(use_reentrant=False)",
)


@dataclasses.dataclass
class Variant:
    """One variant's step at the fit's context: `peak` (bytes, without the allocator's share) and `phases`
    (phase -> bytes held over weights and optimizer state), and the parts the report prints."""

    name: str
    kept_per_layer: int = 0
    kept_outside: int = 0
    head_transient: int = 0
    layer_transient: int = 0
    peak: int = 0
    phases: dict = dataclasses.field(default_factory=dict)
    modes: list = None
    error: str = None


@dataclasses.dataclass
class Fit:
    """The projection: `parts` (bytes by part), `variants` (name -> Variant with its peak), `max_context`
    (name -> longest context per sample that fits, or 0), `not_modelled` (what the model leaves out)."""

    model_type: str
    form: TrainingForm
    batch: int
    seq_len: int
    gpu_bytes: int
    num_layers: int
    parts: dict
    variants: dict
    max_context: dict = dataclasses.field(default_factory=dict)
    not_modelled: tuple = NOT_MODELLED

    def fits(self, name):
        v = self.variants[name]
        return v.error is None and v.peak * (1 + ALLOCATOR_SHARE) <= self.gpu_bytes


@dataclasses.dataclass
class _Layered:
    """A variant's simulated 1- and 2-layer steps, read as the terms of the L-layer step."""

    one: simulate.Step
    two: simulate.Step

    def _line(self, field):
        a, b = getattr(self.one, field), getattr(self.two, field)
        return lambda L: a + (L - 1) * (b - a)

    @property
    def kept(self):
        """Bytes one decoder layer keeps for backward."""
        return self.two.forward_end - self.one.forward_end

    @property
    def grads_per_layer(self):
        return self.two.grads - self.one.grads

    def most(self, phase, two=False):
        return (self.two if two else self.one).phases[phase][1]

    def transient(self, phase):
        start, most = self.one.phases[phase]
        return most - start


class _Model:
    """What does not depend on the layer count: the config, the form, simulated steps by context."""

    def __init__(self, config, form):
        self.config, self.form = config, form
        self.num_layers = config.num_hidden_layers
        self._steps = {}

    def ours_error(self):
        from ..models import model_specs

        if self.config.model_type not in model_specs():
            return (f"model type {self.config.model_type!r} is not converted by selective_ckpt (converted: "
                    f"{', '.join(sorted(model_specs()))})")
        return None

    def layered(self, kind, batch, seq_len):
        """_Layered of one simulated kind ("transformers", "checkpointing", "none", "selective", "full")."""
        if (kind, batch, seq_len) not in self._steps:
            kinds = ("transformers", "checkpointing") if kind in ("transformers", "checkpointing") else \
                ("none", "selective", "full")
            steps = {k: [] for k in kinds}
            for layers in (1, 2):
                for k, step in self._simulate(layers, kinds, batch, seq_len).items():
                    steps[k].append(step)
            for k, (one, two) in steps.items():
                self._steps[k, batch, seq_len] = _Layered(one, two)
        return self._steps[kind, batch, seq_len]

    def _simulate(self, layers, kinds, batch, seq_len):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from ..models.moe import even_routing

        out = {}
        with FakeTensorMode(allow_non_fake_inputs=True), _quiet(), even_routing(), simulate.grouped_matmuls():
            model = simulate.build(self.config, layers, self.form)
            autocast = self.form.autocast
            if "transformers" in kinds:
                simulate.even_routing(model)
                out["transformers"] = simulate.run_step(model, batch, seq_len, autocast)
                simulate.checkpointing(model, True)
                out["checkpointing"] = simulate.run_step(model, batch, seq_len, autocast)
                return out
            from .. import convert, set_recompute

            convert(model)
            for mode in kinds:
                set_recompute(model, mode)
                out[mode] = simulate.run_step(model, batch, seq_len, autocast)
        return out


@contextlib.contextmanager
def _quiet():
    """The simulated steps' warnings (transformers' deprecations, the mode announcement) are not the user's."""
    import logging
    import warnings

    logs = [logging.getLogger(name) for name in ("selective_ckpt", "transformers")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _phases(layered, modes, L):
    """Bytes held over weights and optimizer state in each phase of an L-layer step whose layer j runs as
    layered[modes[j]] (one kind for every layer, or a per-layer plan).

    What one more layer adds to a phase is read off the 2-layer step: to a later layer's forward and to the
    head, what it holds then (its kept bytes and its part of the KV cache); to the loss backward, likewise; to
    a later layer's backward, its kept bytes k; to an earlier layer's backward, its weights' gradients g. The
    first layer is a layer of its own: its input is no activation (with frozen embeddings its backward forms
    no gradient of it, and under LoRA with autocast its forward saves less), so the other layers' forward and
    backward are read off the 2-layer step's second layer.
    """
    def step(m, phase, two_phase=None):
        return layered[m].most(two_phase or phase, two=True) - layered[m].most(phase)

    kinds = set(modes)
    head = {m: step(m, "head") for m in kinds}  # what a layer holds while later ones run: kept bytes, KV cache
    loss = {m: step(m, "loss backward") for m in kinds}
    kept = [layered[m].kept for m in modes]
    below = [0] * L
    for j in range(1, L):
        below[j] = below[j - 1] + kept[j - 1]
    g = layered[modes[0]].grads_per_layer
    first, last = layered[modes[0]], layered[modes[-1]]
    if L == 1:
        backward = first.most(("backward", 0))
    else:
        backward = max([first.most(("backward", 0), two=True) + (L - 2) * g] +
                       [layered[m].most(("backward", 1), two=True) - layered[m].kept + below[j] + (L - 1 - j) * g
                        for j, m in enumerate(modes) if j])
    forward, ahead = first.most(("forward", 0)), head[modes[0]]
    for m in modes[1:]:
        forward = max(forward, layered[m].most(("forward", 1), two=True) - head[m] + ahead)
        ahead += head[m]
    return {
        "embedding": first.most("embedding"),
        "forward": forward,
        "head": last.most("head") + sum(head[m] for m in modes[:-1]),
        "loss backward": last.most("loss backward") + sum(loss[m] for m in modes[:-1]),
        "layer backward": backward,
        "optimizer": first.most("optimizer") + (L - 1) * step(modes[0], "optimizer"),
    }


def _variant(name, layered, modes, L):
    kinds = {m: layered[m] for m in modes}
    v = Variant(name, modes=list(modes) if name == "ours plan" else None)
    base = kinds[modes[0]]
    v.phases = _phases(kinds, modes, L)
    # the first layer may keep less than the others (its input is no activation): what one step keeps at the
    # forward's end is L layers' and the rest, the rest being at least 0
    forward_end = base.one.forward_end - base.kept + sum(kinds[m].kept for m in modes)
    v.kept_outside = max(0, base.one.forward_end - base.kept)
    v.kept_per_layer = (forward_end - v.kept_outside) // L
    v.head_transient = max(v.phases["head"], v.phases["loss backward"]) - forward_end
    v.layer_transient = max(kinds[m].transient(("backward", 0)) for m in modes)
    v.peak = base._line("weights")(L) + base._line("state")(L) + max(v.phases.values())
    return v


def _parts(layered, L):
    return {"weights": layered._line("weights")(L), "gradients": layered._line("grads")(L),
            "optimizer state": layered._line("state")(L)}


def _variants(model, batch, seq_len, gpu_bytes=None, names=VARIANTS):
    out = {}
    L = model.num_layers
    for name in names:
        if name == "ours plan":
            continue
        if name.startswith("ours") and model.ours_error():
            out[name] = Variant(name, error=model.ours_error())
            continue
        kind = _SIMULATED[name]
        out[name] = _variant(name, {kind: model.layered(kind, batch, seq_len)}, [kind] * L, L)
    if "ours plan" in names and gpu_bytes is not None:
        out["ours plan"] = _plan_variant(model, batch, seq_len, gpu_bytes)
    return out


def _plan_variant(model, batch, seq_len, gpu_bytes):
    """The per-layer modes with the least recompute that fit `gpu_bytes`: the fewest "full" layers, then the
    fewest "selective" (the rest "none"); "full" layers first, as memory.plan places them (their re-run comes
    last in backward, when the fewest activations are still kept)."""
    if model.ours_error():
        return Variant("ours plan", error=model.ours_error())
    L = model.num_layers
    layered = {m: model.layered(m, batch, seq_len) for m in ("none", "selective", "full")}
    for n_full in range(L + 1):
        for n_sel in range(L - n_full + 1):
            modes = ["full"] * n_full + ["selective"] * n_sel + ["none"] * (L - n_full - n_sel)
            v = _variant("ours plan", layered, modes, L)
            if v.peak * (1 + ALLOCATOR_SHARE) <= gpu_bytes:
                return v
    v.error = "no per-layer plan fits"
    return v


def predict(config, batch, seq_len, form=None, names=VARIANTS):
    """{variant name: Variant} (its `peak` and `phases` in bytes) of one step at `batch` x `seq_len`;
    "ours plan" needs a budget (fit) and is left out here."""
    from .configs import load_config

    check_positive_int(batch, "batch")
    check_positive_int(seq_len, "seq_len")
    model = _Model(load_config(config), _form(form))
    return _variants(model, batch, seq_len, names=tuple(n for n in names if n != "ours plan"))


def _form(form):
    form = form if form is not None else TrainingForm()
    if not isinstance(form, TrainingForm):
        raise TypeError(f"form must be a TrainingForm, got {type(form).__name__}")
    return form


# contexts of the two simulated steps the longest context is read from (past ours' loss-head chunk length)
_PROBES = (4096, 8192)


def fit(config, gpu_bytes, batch=1, seq_len="max", form=None):
    """Projects one training step's peak memory for `config` (load_config's input) on a GPU of
    `gpu_bytes`, per variant (VARIANTS), and the longest context per sample that fits each.

    `seq_len`: tokens per sample, or "max" (the report is then at the longest context ours fits with
    "selective"). `form`: a TrainingForm (default: full fine-tune, AdamW, float32).
    """
    from .configs import load_config

    config = load_config(config)
    form = _form(form)
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) or gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be a positive number of bytes, got {gpu_bytes!r}")
    check_positive_int(batch, "batch")
    if seq_len != "max":
        check_positive_int(seq_len, "seq_len")
    model = _Model(config, form)
    fixed = _fixed(model, batch)
    if fixed >= gpu_bytes:
        raise ValueError(f"gpu_bytes: {gpu_bytes} bytes is not more than the weights and optimizer state alone "
                         f"({fixed} bytes)")
    limit = getattr(config, "max_position_embeddings", None) or 1 << 20
    max_context = {name: _longest(model, batch, name, gpu_bytes, limit) for name in VARIANTS}
    if seq_len == "max":
        seq_len = max_context["ours selective"] or max(max_context.values()) or 1
    variants = _variants(model, batch, seq_len, gpu_bytes)
    ok = next(v for v in variants.values() if v.error is None)
    kind = "transformers" if ok.name.startswith("transformers") else "selective"
    parts = _parts(model.layered(kind, batch, seq_len), model.num_layers)
    return Fit(config.model_type, form, batch, seq_len, int(gpu_bytes), model.num_layers, parts, variants,
               max_context)


def _fixed(model, batch):
    """Weights and optimizer state: what the step holds before it starts."""
    layered = model.layered("transformers", batch, _PROBES[0])
    L = model.num_layers
    return layered._line("weights")(L) + layered._line("state")(L)


def _longest(model, batch, name, gpu_bytes, limit):
    """Longest context per sample whose peak (with the allocator's share) fits, 0 if none: each phase is
    linear in the context, read off steps simulated at the two _PROBES contexts, and the peak is the largest
    phase; a plan fits wherever every layer "full" does."""
    if name == "ours plan":
        name = "ours full"
    lo, hi = (_variants(model, batch, s, names=(name,))[name] for s in _PROBES)
    if lo.error is not None:
        return 0
    budget = gpu_bytes / (1 + ALLOCATOR_SHARE)
    fixed_lo, fixed_hi = lo.peak - max(lo.phases.values()), hi.peak - max(hi.phases.values())
    best = limit
    s0, s1 = _PROBES
    for phase in lo.phases:
        a_lo, a_hi = fixed_lo + lo.phases[phase], fixed_hi + hi.phases[phase]
        slope = (a_hi - a_lo) / (s1 - s0)
        at_zero = a_lo - slope * s0
        if at_zero > budget:
            return 0
        if slope > 0:
            best = min(best, int((budget - at_zero) // slope))
    return max(0, best)


__all__ = ["ALLOCATOR_SHARE", "Fit", "NOT_MODELLED", "VARIANTS", "Variant", "fit", "predict"]
