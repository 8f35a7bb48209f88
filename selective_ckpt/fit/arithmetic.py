"""The step's peak, by part, for any number of layers and any context, from simulated 1- and 2-layer steps.

Each variant (transformers' model as it trains by default, with activation checkpointing, and converted in each
recompute mode) is simulated at full width on fake tensors (simulate.py) with one and with two decoder
layers. What a step holds in each phase, over the weights and the optimizer state, grows with the layer count
in a known way: the forward of layer j holds the kept bytes k of the j layers before it; the head and the loss
hold all L layers' k; the backward of layer j holds the k of the layers below it and the gradients g of the
trained weights above it; the optimizer step holds every gradient. So with a 1-layer step's phases and k and
g from the 2-layer one, a model of L layers (each in its own recompute mode, for a per-layer plan) is

    peak = weights + optimizer state + max(forward of layer j, head, loss backward, backward of layer j,
                                           optimizer step)

Every term is linear in the context as well (fused attention keeps O(S) per layer; ours' loss head works in
chunks of fixed size once there are more tokens than a chunk), so the figures at any context are read off the
line through the nearest two simulated contexts (_Projection: 4096 and 8192, the asked context, and for "max"
up to _ROUNDS more near the answer). A phase's most is a maximum over moments, and a maximum of lines bends
where another moment takes over, so the line is checked rather than trusted: each longest context is the
largest at which this projection fits, with the next context past it not fitting (_search), and the report's
rows come from the same projection, so a row at its own longest context says it fits.
"""

import collections
import contextlib
import dataclasses

from ..validation import check_positive_int
from . import simulate
from .forms import TrainingForm

VARIANTS = ("transformers", "transformers + gradient checkpointing", "ours none", "ours selective", "ours full",
            "ours full, inputs offloaded", "ours attention-kept", "ours attention-kept, inputs offloaded",
            "ours plan")
_SIMULATED = {"transformers": "transformers", "transformers + gradient checkpointing": "checkpointing",
              "ours none": "none", "ours selective": "selective", "ours full": "full",
              "ours attention-kept": "attention-kept"}
# variants whose layers copy their input to host memory (keeping.policy(mode, offload=["input"])), by the
# simulated mode they otherwise run
_INPUTS_OFFLOADED = {"ours full, inputs offloaded": "full",
                     "ours attention-kept, inputs offloaded": "attention-kept"}
ALLOCATOR_SHARE = 0.05  # the caching allocator's rounding and fragmentation, as a share of the peak

NOT_MODELLED = (
    "CUDA context and kernel workspaces (cuBLAS, the fused attention's scratch): outside the caching allocator",
    "the caching allocator's fragmentation beyond a flat 5 % share",
    "mixture-of-experts routing: the routed rows are split evenly between the experts where the split matters (what "
    "each layer keeps does not depend on it, the busiest expert's transients do); the experts run the "
    "implementation the config names, else grouped_mm (from_pretrained's choice where torch has grouped matmuls)",
    "data-loader and host memory other than the offloaded layer inputs' copies; distributed (ZeRO/FSDP) sharding",
    "the step is simulated with PyTorch's CPU kernels: attention keeps what CPU SDPA's fused kernel keeps (q, k, "
    "v, output, logsumexp, the mask when there is one), as the GPU's flash and memory-efficient kernels do",
    "QLoRA bases are NF4 with one float32 absmax per 64 weights and bf16 compute (no double quantization)",
    "transformers' activation checkpointing (gradient checkpointing) runs torch.utils.checkpoint(use_reentrant="
    "False) on every decoder layer",
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
    host: int = 0  # bytes in (pinned) host memory: the offloaded layer inputs of every layer but the last
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
    # name -> the variant whose longest context a row's is (the plan's is every layer "full"'s when no other
    # plan fits longer), for rows whose figure is another row's
    max_context_from: dict = dataclasses.field(default_factory=dict)
    # "simulated" when the figures at seq_len come from steps simulated at that context, else how they were
    # read off the simulated ones (seq_len "max" lands between simulated contexts)
    source: str = "simulated"
    seq_len_asked: object = None  # the seq_len fit was given: a number of tokens, or "max"
    _projection: object = dataclasses.field(default=None, repr=False, compare=False)

    def fits(self, name):
        v = self.variants[name]
        return v.error is None and _fits(v.peak, self.gpu_bytes)

    def at(self, name, seq_len):
        """The Variant `name` at another context, from the same simulated steps (the projection the longest
        contexts come from): simulated where one was, else linear between the nearest simulated contexts."""
        if name not in VARIANTS:
            raise ValueError(f"name must be one of {VARIANTS}, got {name!r}")
        check_positive_int(seq_len, "seq_len")
        return _variants(self._projection, seq_len, self.gpu_bytes, names=(name,))[name]

    def fits_at(self, name, seq_len):
        """Whether `name` fits the GPU at `seq_len` by the projection (`at`)."""
        v = self.at(name, seq_len)
        return v.error is None and _fits(v.peak, self.gpu_bytes)


def _fits(peak, gpu_bytes):
    """The one test of fitting every figure of the fit uses: the peak with the allocator's share."""
    return peak * (1 + ALLOCATOR_SHARE) <= gpu_bytes


class BudgetError(ValueError):
    """The GPU holds less than the weights and optimizer state alone: `gpu_bytes`, `fixed` (bytes), `form`."""

    def __init__(self, gpu_bytes, fixed, form):
        self.gpu_bytes, self.fixed, self.form = gpu_bytes, fixed, form
        hints = " or ".join(f"TrainingForm({k!r})" for k in _lighter_forms(form))
        super().__init__(f"gpu_bytes: {gpu_bytes:.0f} bytes ({_gib(gpu_bytes)}) holds less than the weights and "
                         f"optimizer state alone ({_gib(fixed)}) for {form}" + (f": try {hints}" if hints else ""))


def _gib(n):
    return f"{n / 2 ** 30:.1f} GiB"


def _lighter_forms(form):
    """Forms that hold less before the step starts than `form`: LoRA trains no base weight, QLoRA stores it in
    4 bits."""
    return {"full": ("lora", "qlora"), "lora": ("qlora",), "qlora": ()}[form.kind]


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
        if not hasattr(self, "_ours_error"):
            from ..models import model_specs

            self._ours_error = None
            if self.config.model_type not in model_specs():
                self._ours_error = (f"model type {self.config.model_type!r} is not converted by selective_ckpt "
                                    f"(converted: {', '.join(sorted(model_specs()))})")
        return self._ours_error

    def layered(self, kind, batch, seq_len):
        """_Layered of one simulated kind ("transformers", "checkpointing", "none", "selective", "full")."""
        if (kind, batch, seq_len) not in self._steps:
            kinds = _GROUPS[_group(kind)]
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


# the simulated kinds, by the run that simulates them together (one model built per group and layer count)
_GROUPS = {"transformers": ("transformers", "checkpointing"), "ours": ("none", "selective", "full"),
           "long": ("attention-kept",)}


def _group(kind):
    return next(g for g, kinds in _GROUPS.items() if kind in kinds)


def _line(a, b, x0, x1, x):
    """The value at x of the line through (x0, a) and (x1, b), rounded up; a and b themselves at x0 and x1."""
    if x == x0:
        return a
    if x == x1:
        return b
    return a - ((b - a) * (x - x0) // -(x1 - x0))


def _step_at(a, b, x0, x1, x):
    """A Step at context x on the line through Steps a (at context x0) and b (at x1), term by term."""
    return simulate.Step(_line(a.weights, b.weights, x0, x1, x), _line(a.state, b.state, x0, x1, x),
                         _line(a.grads, b.grads, x0, x1, x),
                         {k: tuple(_line(p, q, x0, x1, x) for p, q in zip(a.phases[k], b.phases[k]))
                          for k in a.phases},
                         _line(a.forward_end, b.forward_end, x0, x1, x))


def _linear_from(config, batch):
    """The context from which every term of a step is linear in it: ours' loss head works in chunks of rows,
    and its transient stops growing once the step has a chunk of tokens (below, a line through it would bend)."""
    from ..ops.cross_entropy import chunk_rows

    rows = chunk_rows(1 << 62, config.vocab_size, config.hidden_size, 4)
    return -(-rows // batch)


class _Projection:
    """A _Model's steps at one batch size, read at any context: the simulated steps where this projection
    simulates the context (the _PROBES, and those `simulate` adds), else the line through the two nearest
    simulated contexts at which every term is linear (past either end, through the two at that end). Each
    kind is simulated when first read."""

    def __init__(self, model, batch):
        self.model, self.batch = model, batch
        self.contexts = {g: set(_PROBES) for g in _GROUPS}
        self.linear_from = _linear_from(model.config, batch)

    @property
    def num_layers(self):
        return self.model.num_layers

    def simulate(self, seq_len, groups=tuple(_GROUPS)):
        """Read the figures at `seq_len` off steps simulated there (simulated when first read)."""
        for g in groups:
            self.contexts[g].add(seq_len)

    def simulated(self, seq_len, groups=tuple(_GROUPS)):
        return all(seq_len in self.contexts[g] for g in groups)

    def layered(self, kind, seq_len):
        contexts = self.contexts[_group(kind)]
        if seq_len in contexts:
            return self.model.layered(kind, self.batch, seq_len)
        x0, x1 = self.between(kind, seq_len)
        a, b = (self.model.layered(kind, self.batch, x) for x in (x0, x1))
        return _Layered(_step_at(a.one, b.one, x0, x1, seq_len), _step_at(a.two, b.two, x0, x1, seq_len))

    def between(self, kind, seq_len):
        """The two simulated contexts the figures of `kind` at `seq_len` are read between."""
        xs = sorted(c for c in self.contexts[_group(kind)] if c >= self.linear_from or c in _PROBES)
        i = next((i for i, x in enumerate(xs) if x > seq_len), len(xs))
        i = min(max(i, 1), len(xs) - 1)
        return xs[i - 1], xs[i]


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


def _phases(layered, modes, L, offloaded=0):
    """Bytes held over weights and optimizer state in each phase of an L-layer step whose layer j runs as
    layered[modes[j]] (one kind for every layer, or a per-layer plan).

    What one more layer adds to a phase is read off the 2-layer step: to a later layer's forward and to the
    head, what it holds then (its kept bytes and its part of the KV cache); to the loss backward, likewise; to
    a later layer's backward, its kept bytes k; to an earlier layer's backward, its weights' gradients g. The
    first layer is a layer of its own: its input is no activation (with frozen embeddings its backward forms
    no gradient of it, and under LoRA with autocast its forward saves less), so the other layers' forward and
    backward are read off the 2-layer step's second layer. Within a run of layers in one mode each phase's
    bytes are linear in the layer's index, so only a run's first and last layer can hold the most.

    `offloaded`: bytes of each layer's keeping that its offload engine copies to host memory (one mode for every
    layer). A layer's copy starts when the next layer's forward begins and the last layer's never: layer j's
    forward holds the offloaded bytes of layers j-1 and j-2 (a copy may be in flight), the head and the loss
    backward those of the last two layers, and layer j's backward those of layer j and the one reloaded ahead of
    it (prefetch 1), so the others' are taken off.
    """
    def step(m, phase, two_phase=None):
        return layered[m].most(two_phase or phase, two=True) - layered[m].most(phase)

    runs = _runs(modes)
    kinds = {m for m, _, _ in runs}
    head = {m: step(m, "head") for m in kinds}  # what a layer holds while later ones run: kept bytes, KV cache
    loss = {m: step(m, "loss backward") for m in kinds}
    kept = {m: layered[m].kept for m in kinds}
    g = layered[modes[0]].grads_per_layer
    first, last = layered[modes[0]], layered[modes[-1]]
    backward = first.most(("backward", 0), two=L > 1) + max(0, L - 2) * g
    forward = first.most(("forward", 0))
    below = ahead = 0  # the kept bytes and the head's share of the layers before a run
    for m, start, stop in runs:
        for j in {max(start, 1), stop - 1}:
            if 1 <= j < stop:
                backward = max(backward, layered[m].most(("backward", 1), two=True) - kept[m] + below +
                               (j - start) * kept[m] + (L - 1 - j) * g - max(0, j - 1) * offloaded)
                forward = max(forward, layered[m].most(("forward", 1), two=True) - head[m] + ahead +
                              (j - start) * head[m] - max(0, j - 2) * offloaded)
        below += (stop - start) * kept[m]
        ahead += (stop - start) * head[m]
    m_last = modes[-1]
    return {
        "embedding": first.most("embedding"),
        "forward": forward,
        "head": last.most("head") + ahead - head[m_last] - max(0, L - 2) * offloaded,
        "loss backward": last.most("loss backward") + sum((stop - start) * loss[m] for m, start, stop in runs)
        - loss[m_last] - max(0, L - 2) * offloaded,
        "layer backward": backward,
        "optimizer": first.most("optimizer") + (L - 1) * step(modes[0], "optimizer"),
    }


def _runs(modes):
    """[(mode, first index, index past the last)] of each run of equal modes."""
    out, start = [], 0
    for j in range(1, len(modes) + 1):
        if j == len(modes) or modes[j] != modes[start]:
            out.append((modes[start], start, j))
            start = j
    return out


def _variant(name, layered, modes, L, offloaded=0):
    runs = _runs(modes)
    kinds = {m: layered[m] for m, _, _ in runs}
    v = Variant(name, modes=list(modes) if name == "ours plan" else None)
    base = kinds[modes[0]]
    v.phases = _phases(kinds, modes, L, offloaded)
    v.host = max(0, L - 1) * offloaded
    # the first layer may keep less than the others (its input is no activation): what one step keeps at the
    # forward's end is L layers' and the rest, the rest being at least 0
    forward_end = base.one.forward_end - base.kept + sum((stop - start) * kinds[m].kept for m, start, stop in runs)
    v.kept_outside = max(0, base.one.forward_end - base.kept)
    v.kept_per_layer = (forward_end - v.kept_outside) // L
    on_device = forward_end - max(0, L - 2) * offloaded  # the inputs copied out by the forward's end
    v.head_transient = max(v.phases["head"], v.phases["loss backward"]) - on_device
    v.layer_transient = max(k.transient(("backward", 0)) for k in kinds.values())
    v.peak = base._line("weights")(L) + base._line("state")(L) + max(v.phases.values())
    return v


def _parts(layered, L):
    return {"weights": layered._line("weights")(L), "gradients": layered._line("grads")(L),
            "optimizer state": layered._line("state")(L)}


def _variants(proj, seq_len, gpu_bytes=None, names=VARIANTS):
    out = {}
    L = proj.num_layers
    for name in names:
        if name == "ours plan":
            continue
        if name.startswith("ours") and proj.model.ours_error():
            out[name] = Variant(name, error=proj.model.ours_error())
            continue
        kind = _SIMULATED.get(name) or _INPUTS_OFFLOADED[name]
        offloaded = _input_bytes(proj, seq_len) if name in _INPUTS_OFFLOADED else 0
        out[name] = _variant(name, {kind: proj.layered(kind, seq_len)}, [kind] * L, L, offloaded)
    if "ours plan" in names and gpu_bytes is not None:
        out["ours plan"] = _plan_variant(proj, seq_len, gpu_bytes)
    return out


def _input_bytes(proj, seq_len):
    """Bytes of one layer's input, the residual stream in the weights' dtype (float32 under autocast and QLoRA)."""
    import torch

    size = torch.empty((), dtype=proj.model.form.weights).element_size()
    return proj.batch * seq_len * proj.model.config.hidden_size * size


def _plan_variant(proj, seq_len, gpu_bytes):
    """The per-layer modes with the least recompute that fit `gpu_bytes`: the fewest "full" layers, then the
    fewest "selective" (the rest "none"); "full" layers first, as memory.plan places them (their re-run comes
    last in backward, when the fewest activations are still kept)."""
    if proj.model.ours_error():
        return Variant("ours plan", error=proj.model.ours_error())
    L = proj.num_layers
    layered = {m: proj.layered(m, seq_len) for m in ("none", "selective", "full")}
    for n_full in range(L + 1):
        for n_sel in range(L - n_full + 1):
            modes = ["full"] * n_full + ["selective"] * n_sel + ["none"] * (L - n_full - n_sel)
            v = _variant("ours plan", layered, modes, L)
            if _fits(v.peak, gpu_bytes):
                return v
    v.error = "no per-layer plan fits"
    return v


def predict(config, batch, seq_len, form=None, names=VARIANTS):
    """{variant name: Variant} (its `peak` and `phases` in bytes) of one step at `batch` x `seq_len`;
    "ours plan" needs a budget (fit) and is left out here."""
    from .configs import load_config, require

    check_positive_int(batch, "batch")
    check_positive_int(seq_len, "seq_len")
    form = _form(form)
    if form.kind != "full":
        require("peft")
    proj = _Projection(_Model(load_config(config), form), batch)
    proj.simulate(seq_len)
    return _variants(proj, seq_len, names=tuple(n for n in names if n != "ours plan"))


def _form(form):
    form = form if form is not None else TrainingForm()
    if not isinstance(form, TrainingForm):
        raise TypeError(f"form must be a TrainingForm, got {type(form).__name__}")
    return form


# contexts of the two simulated steps the longest context is read from (past ours' loss-head chunk length)
_PROBES = (4096, 8192)
# with seq_len "max": at most this many more contexts simulated near the answer, so that its figures are a
# simulation's (each such step moves the line the answer is read from closer to the steps there)
_ROUNDS = 3
# simulated steps of the last configs and forms fit() saw (a few MiB at most): asking again, for another
# budget or context, reads the same steps
_CACHE = collections.OrderedDict()
_CACHE_SIZE = 4


def _model(config, form):
    key = (config.to_json_string(use_diff=False), form,
           getattr(config, "_attn_implementation_internal", None),
           getattr(config, "_experts_implementation_internal", None))
    if key not in _CACHE:
        _CACHE[key] = _Model(config, form)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    return _CACHE[key]


def fit(config, gpu_bytes, batch=1, seq_len="max", form=None):
    """Projects one training step's peak memory for `config` (load_config's input) on a GPU of
    `gpu_bytes`, per variant (VARIANTS), and the longest context per sample that fits each.

    `seq_len`: tokens per sample, or "max" (the report is then at the longest context ours fits with
    "selective"). `form`: a TrainingForm (default: full fine-tune, AdamW, float32).

    The longest contexts fit by construction: each is the largest context at which the projection (the
    simulated steps where there is one, else the line through the nearest simulated contexts; Fit.at) fits,
    the next one not (or the config's max_position_embeddings). Raises BudgetError (a ValueError) when the
    GPU holds less than the weights and optimizer state alone. The simulated steps of the last few configs
    and forms are kept, so another budget or context of the same config and form costs no simulation there.
    """
    from .configs import load_config, require

    config = load_config(config)
    form = _form(form)
    if form.kind != "full":
        require("peft")
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) or gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be a positive number of bytes, got {gpu_bytes!r}")
    check_positive_int(batch, "batch")
    if seq_len != "max":
        check_positive_int(seq_len, "seq_len")
    asked = seq_len
    proj = _Projection(_model(config, form), batch)
    fixed = _fixed(proj)
    if fixed >= gpu_bytes:
        raise BudgetError(gpu_bytes, fixed, form)
    limit = getattr(config, "max_position_embeddings", None) or 1 << 20
    if seq_len != "max":
        proj.simulate(seq_len)
    max_context, sources = _longest_all(proj, gpu_bytes, limit)
    if seq_len == "max":
        target = "ours selective" if max_context["ours selective"] else max(VARIANTS, key=max_context.get)
        group = (_group(_SIMULATED[target]),) if target in _SIMULATED else tuple(_GROUPS)
        for _ in range(_ROUNDS):
            at = max(1, max_context[target])
            if proj.simulated(at, group):
                break
            proj.simulate(at, group)
            max_context, sources = _longest_all(proj, gpu_bytes, limit)
        seq_len = max(1, max_context[target])
        if not proj.simulated(seq_len):  # the other rows at the same context, simulated too
            proj.simulate(seq_len, tuple(g for g in _GROUPS if g not in group or not proj.simulated(seq_len, (g,))))
            max_context, sources = _longest_all(proj, gpu_bytes, limit)
            seq_len = max(1, max_context[target])
    variants = _variants(proj, seq_len, gpu_bytes)
    ok = next(v for v in variants.values() if v.error is None)
    kind = "transformers" if ok.name.startswith("transformers") else "selective"
    parts = _parts(proj.layered(kind, seq_len), proj.num_layers)
    return Fit(config.model_type, form, batch, seq_len, int(gpu_bytes), proj.num_layers, parts, variants,
               max_context, max_context_from=sources, source=_source(proj, seq_len), seq_len_asked=asked,
               _projection=proj)


def _source(proj, seq_len):
    if proj.simulated(seq_len):
        return "simulated"
    x0, x1 = proj.between("selective", seq_len)
    return f"read off the steps simulated at {x0} and {x1} tokens (each term linear in the context)"


def _fixed(proj):
    """Weights and optimizer state: what the step holds before it starts."""
    layered = proj.layered("transformers", _PROBES[0])
    L = proj.num_layers
    return layered._line("weights")(L) + layered._line("state")(L)


def _longest_all(proj, gpu_bytes, limit):
    """({name: longest context that fits}, {name: the variant it is read from, where another})."""
    out, sources = {}, {}
    for name in VARIANTS:
        if name != "ours plan":
            out[name] = _longest(proj, name, gpu_bytes, limit)
    out["ours plan"], source = _longest_plan(proj, gpu_bytes, limit, out["ours full"])
    if source:
        sources["ours plan"] = source
    return out, sources


def _guess(proj, name, gpu_bytes, limit):
    """Where the line through the _PROBES steps meets the budget, phase by phase: a first guess."""
    lo, hi = (_variants(proj, s, names=(name,))[name] for s in _PROBES)
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
    return best


def _longest(proj, name, gpu_bytes, limit):
    """Longest context per sample whose projected peak (with the allocator's share) fits, 0 if none: the
    line's guess, then checked against the projection itself, a step at a time outwards and halving back in,
    until the answer fits and the next context does not (or the answer is `limit`)."""
    if _variants(proj, _PROBES[0], names=(name,))[name].error is not None:
        return 0

    def fits(s):
        return _fits(_variants(proj, s, names=(name,))[name].peak, gpu_bytes)

    return _search(fits, _guess(proj, name, gpu_bytes, limit), limit)


def _longest_plan(proj, gpu_bytes, limit, full):
    """The plan's longest context and the variant it comes from: every layer "full" is a plan, so the plan fits
    at least as long as "ours full" (`full`); longer where another plan fits there too."""
    if proj.model.ours_error():
        return 0, None

    def fits(s):
        return _plan_variant(proj, s, gpu_bytes).error is None

    if full >= limit or not fits(full + 1):
        return full, "ours full"
    return _search(fits, full + 1, limit), None


def _search(fits, guess, limit):
    """The largest context in [1, limit] at which `fits` (true up to some context, false past it) holds, 0 if
    none: from `guess`, steps doubling outwards until the answer is bracketed, then halving."""
    guess = min(max(1, guess), limit)
    step = 1
    if fits(guess):
        lo = guess
        while True:
            hi = min(limit, lo + step)
            if hi == lo:
                return lo
            if not fits(hi):
                break
            lo, step = hi, step * 2
    else:
        hi = guess
        while True:
            lo = max(0, hi - step)
            if lo == 0 or fits(lo):
                break
            hi, step = lo, step * 2
    while hi - lo > 1:  # lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


__all__ = ["ALLOCATOR_SHARE", "BudgetError", "Fit", "NOT_MODELLED", "VARIANTS", "Variant", "fit", "predict"]
