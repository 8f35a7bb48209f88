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

from .. import compat, keeping
from . import simulate, step_cache
from .forms import TrainingForm

TRANSFORMERS_OFFLOADED = "transformers + offloaded checkpointing"
VARIANTS = ("transformers", "transformers + gradient checkpointing", TRANSFORMERS_OFFLOADED, "ours none",
            "ours selective", "ours full",
            "ours full, inputs offloaded", "ours attention-kept", "ours attention-kept, inputs offloaded",
            "ours plan")
_SIMULATED = {"transformers": "transformers", "transformers + gradient checkpointing": "checkpointing",
              "ours none": "none", "ours selective": "selective", "ours full": "full",
              "ours attention-kept": "attention-kept"}
# variants whose layers copy their input to host memory (keeping.policy(mode, offload=["input"])), by the
# simulated mode they otherwise run
_INPUTS_OFFLOADED = {TRANSFORMERS_OFFLOADED: "checkpointing", "ours full, inputs offloaded": "full",
                     "ours attention-kept, inputs offloaded": "attention-kept"}
ALLOCATOR_SHARE = 0.05  # the caching allocator's rounding and fragmentation, as a share of the peak
PROGRESS = None  # a callable taking a line, told of each simulation as it starts (the CLI's stderr), or None;
# steps read from disk (step_cache) are not told

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
    "a hybrid's Gated DeltaNet layers keep what transformers' torch fallback saves (its chunked recurrence in "
    "float32); fla's kernels, which transformers runs on a GPU where they are installed, save other tensors",
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
    host: int = 0  # bytes in (pinned) host memory: the offloaded copies
    phases: dict = dataclasses.field(default_factory=dict)
    step_seconds: float = None  # the time model's (fit.timing), with the Fit's rates
    tokens_per_second: float = None
    modes: list = None
    error: str = None
    unfit: bool = False  # the error says nothing fits the budgets (the variant is modelled; it does not fit)


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
        self._class_bytes = {}
        self._cost = None

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
            kinds = _kinds(_group(kind))
            steps = {k: [] for k in kinds}
            for layers in (1, 2):
                for k, step in self._simulate_layers(layers, kinds, batch, seq_len).items():
                    steps[k].append(step)
            for k, (one, two) in steps.items():
                self._steps[k, batch, seq_len] = _Layered(one, two)
        return self._steps[kind, batch, seq_len]

    def _simulate_layers(self, layers, kinds, batch, seq_len):
        """The simulated steps of `layers` (1 or 2) decoder layers. A hybrid stack (layers of a kind holding a
        token mixer instead of attention, config.layer_types "linear_attention") is read as its first layer then
        layers alike: the 1-layer step is its first layer, and the 2-layer step the mean of the 2-layer steps
        adding a layer of each kind to it, weighted by how many of the model's other layers are of that kind, so
        each term grows per layer by the average of the kinds' and the whole depth holds each kind's count."""
        counts = _layer_kinds(self.config)
        if counts is None:
            return self._simulate(layers, kinds, batch, seq_len)
        first = self.config.layer_types[0]
        if layers == 1:
            return self._simulate(1, kinds, batch, seq_len, [first])
        other = self.num_layers - 1
        parts = [(kind, (n - (kind == first)) / other) for kind, n in counts.items()]
        runs = [(w, self._simulate(2, kinds, batch, seq_len, [first, kind])) for kind, w in parts if w > 0]
        return {k: _mean([(w, run[k]) for w, run in runs]) for k in runs[0][1]}

    def _simulate(self, layers, kinds, batch, seq_len, layer_types=None):
        """{kind: Step} of `kinds` simulated together with `layers` decoder layers (kept on disk: step_cache)."""
        name = step_cache.key(self.config, self.form, kinds, batch, seq_len, layers, layer_types)
        found = step_cache.load(name, kinds)
        if found is not None:
            out, class_bytes = found
            for mode, split in class_bytes.items():
                self._class_bytes.setdefault(mode, split)
            return out
        if PROGRESS is not None:  # only what is simulated: steps on disk are read without a word
            PROGRESS(f"simulating {', '.join(map(str, kinds))} at {batch} x {seq_len} tokens, {layers} layer"
                     + ("s" if layers > 1 else ""))
        learned = {}
        out = self._simulate_here(layers, kinds, batch, seq_len, layer_types, learned)
        for mode, split in learned.items():
            self._class_bytes.setdefault(mode, split)
        step_cache.store(name, kinds, out, learned)
        return out

    def _simulate_here(self, layers, kinds, batch, seq_len, layer_types, class_bytes):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from ..models.moe import even_routing

        out = {}
        config = self.config
        if layer_types is not None:  # the hybrid's layers asked, first (simulate.build keeps the first `layers`)
            config = config.__class__.from_dict(config.to_dict())
            config.layer_types = list(layer_types) + list(self.config.layer_types)[len(layer_types):]
            if "full_attention" not in layer_types[:layers]:
                # a kv cache of linear-attention layers alone cannot build the attention mask: such a first layer
                # runs without one (its cached conv and recurrent states, a few rows per layer, are left out)
                config.use_cache = False
            # the implementations set on the config, which to_dict leaves out
            original = self.config
            compat.set_requested_attention_implementation(config, compat.requested_attention_implementation(original))
            if compat.names_experts_implementation(original):
                compat.set_requested_experts_implementation(config, compat.requested_experts_implementation(original))
        with FakeTensorMode(allow_non_fake_inputs=True), _quiet(), even_routing(), simulate.grouped_matmuls():
            model = simulate.build(config, layers, self.form)
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
                if layers == 2:
                    recompute = keeping.resolve(mode).recompute
                    if recompute not in class_bytes:
                        class_bytes[recompute] = _class_bytes(model, autocast)
        return out

    def class_bytes(self, mode):
        """{class: device bytes per token} a decoder layer keeps in recompute mode `mode` (the estimate's, which
        the ledger measures: tests/keeping), read from the converted model of a simulated step."""
        if mode not in self._class_bytes:
            self.layered(mode, 1, _PROBES[0])
        return self._class_bytes[mode]

    @property
    def cost(self):
        """The step's work (fit.timing.StepCost) for the time model."""
        if self._cost is None:
            from .cost import step_cost

            self._cost = step_cost(self.config, self.form)
        return self._cost


def _layer_kinds(config):
    """{layer type: count} of a hybrid stack (config.layer_types holding "linear_attention", whose layers hold a
    token mixer instead of attention, and another type), else None: a stack of layers alike."""
    types = list(getattr(config, "layer_types", None) or ())[:config.num_hidden_layers]
    if "linear_attention" not in types or len(set(types)) < 2:
        return None
    return dict(collections.Counter(types))


def _mean(weighted):
    """The Step whose every term is the weighted mean of the Steps' (weights summing to 1), rounded up."""
    def mean(values):
        return -int(-sum(w * v for (w, _), v in zip(weighted, values)) // 1)

    steps = [s for _, s in weighted]
    return simulate.Step(mean([s.weights for s in steps]), mean([s.state for s in steps]),
                         mean([s.grads for s in steps]),
                         {k: tuple(mean([s.phases[k][i] for s in steps]) for i in range(2)) for k in steps[0].phases},
                         mean([s.forward_end for s in steps]))


_CLASS_TOKENS = 1024  # tokens the per-class bytes are estimated at (every class's bytes are per token)


def _class_bytes(model, autocast):
    from ..models.configuration import layer_estimate
    from ..registry import recomputable_layers

    layer = recomputable_layers(model)[-1]
    split = layer_estimate(layer, _CLASS_TOKENS, 1, autocast_dtype=autocast, breakdown="class")
    return {c: v["device"] / _CLASS_TOKENS for c, v in split.items() if c in keeping.CLASSES and v["device"]}


# the simulated kinds, by the run that simulates them together (one model built per group and layer count); a
# policy of another kind (a checkpointed mode with its MLP in tiles: keeping.policy(mode, mlp_tiles=n)) is a
# group of its own, simulated when first read
_GROUPS = {"transformers": ("transformers", "checkpointing"), "ours": ("none", "selective", "full"),
           "long": ("attention-kept",)}


def _group(kind):
    return next((g for g, kinds in _GROUPS.items() if kind in kinds), kind)


def _kinds(group):
    return _GROUPS.get(group, (group,))


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
        # contexts simulated for every group, those created later (a tiled policy's) included
        self.everywhere = set(_PROBES)
        self.contexts = collections.defaultdict(lambda: set(self.everywhere))
        self.linear_from = _linear_from(model.config, batch)
        # (kind, seq_len) -> its _Layered: a plan's search reads the same few a million times, each a line drawn
        # between two simulated contexts; valid until `simulate` adds a context (the only change to `contexts`)
        self._read = {}

    @property
    def num_layers(self):
        return self.model.num_layers

    def simulate(self, seq_len, groups=None):
        """Read the figures at `seq_len` off steps simulated there (simulated when first read): for `groups`, or
        None for every group, those first read later too."""
        if groups is None:
            self.everywhere.add(seq_len)
            groups = tuple(set(_GROUPS) | set(self.contexts))
        for g in groups:
            self.contexts[g].add(seq_len)
        self._read.clear()

    def simulated(self, seq_len, groups=tuple(_GROUPS)):
        return all(seq_len in self.contexts[g] for g in groups)

    def layered(self, kind, seq_len):
        found = self._read.get((kind, seq_len))
        if found is None:
            found = self._read[kind, seq_len] = self._layered(kind, seq_len)
        return found

    def _layered(self, kind, seq_len):
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


def _phases(layered, modes, L, offloaded=None, prefetch=1, first_offloaded=None, in_flight=2):
    """Bytes held over weights and optimizer state in each phase of an L-layer step whose layer j runs as
    layered[modes[j]] (one kind for every layer, or a per-layer plan).

    What one more layer adds to a phase is read off the 2-layer step: to a later layer's forward and to the
    head, what it holds then (its kept bytes and its part of the KV cache); to the loss backward, likewise; to
    a later layer's backward, its kept bytes k; to an earlier layer's backward, its weights' gradients g. The
    first layer is a layer of its own: its input is no activation (with frozen embeddings its backward forms
    no gradient of it, and under LoRA with autocast its forward saves less), so the other layers' forward and
    backward are read off the 2-layer step's second layer. Within a run of layers in one mode each phase's
    bytes are linear in the layer's index, so only a run's first and last layer can hold the most.

    `offloaded`: {mode: bytes of a layer's keeping that its offload engine copies to host memory}. A layer's copy
    starts when the next layer's forward begins and the last layer's never: layer j's forward holds the
    offloaded bytes of layers j-1 and j-2 (a copy may be in flight), the head and the loss backward those of the
    last two layers, and layer j's backward those of layer j and the `prefetch` layers reloaded ahead of it, so
    the others' are taken off. `first_offloaded`: what the first layer offloads, where it keeps less than the
    others (its input is no activation). `in_flight` 1: copies finish within the next layer's forward (the time
    model says when), so layer j's forward holds layer j-1's only.
    """
    def step(m, phase, two_phase=None):
        return layered[m].most(two_phase or phase, two=True) - layered[m].most(phase)

    off = _offloads(modes, offloaded, first_offloaded)
    on_host = [0]  # on_host[n]: bytes the first n layers offload
    for b in off:
        on_host.append(on_host[-1] + b)

    def copied(n):  # what the first n layers (none if n < 1) have in host memory
        return on_host[max(0, min(n, L))]

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
                               (j - start) * kept[m] + (L - 1 - j) * g - copied(j - prefetch))
                forward = max(forward, layered[m].most(("forward", 1), two=True) - head[m] + ahead +
                              (j - start) * head[m] - copied(j - in_flight))
        below += (stop - start) * kept[m]
        ahead += (stop - start) * head[m]
    m_last = modes[-1]
    return {
        "embedding": first.most("embedding"),
        "forward": forward,
        "head": last.most("head") + ahead - head[m_last] - copied(L - in_flight),
        "loss backward": last.most("loss backward") + sum((stop - start) * loss[m] for m, start, stop in runs)
        - loss[m_last] - copied(L - in_flight),
        "layer backward": backward,
        "optimizer": first.most("optimizer") + (L - 1) * step(modes[0], "optimizer"),
    }


def _offloads(modes, offloaded, first_offloaded):
    off = [(offloaded or {}).get(m, 0) for m in modes]
    if first_offloaded is not None and off:
        off[0] = first_offloaded
    return off


def _runs(modes):
    """[(mode, first index, index past the last)] of each run of equal modes."""
    out, start = [], 0
    for j in range(1, len(modes) + 1):
        if j == len(modes) or modes[j] != modes[start]:
            out.append((modes[start], start, j))
            start = j
    return out


def _variant(name, layered, modes, L, offloaded=None, prefetch=1, first_offloaded=None, in_flight=2):
    """The Variant `name` of an L-layer step whose layer j runs as layered[modes[j]], offloading
    offloaded[modes[j]] bytes (the first layer `first_offloaded` where given; see _phases)."""
    runs = _runs(modes)
    kinds = {m: layered[m] for m, _, _ in runs}
    v = Variant(name, modes=list(modes) if name == "ours plan" else None)
    base = kinds[modes[0]]
    v.phases = _phases(kinds, modes, L, offloaded, prefetch, first_offloaded, in_flight)
    off = _offloads(modes, offloaded, first_offloaded)
    v.host = sum(off[:-1])  # every layer's copy but the last's
    # the first layer may keep less than the others (its input is no activation): what one step keeps at the
    # forward's end is L layers' and the rest, the rest being at least 0
    forward_end = base.one.forward_end - base.kept + sum((stop - start) * kinds[m].kept for m, start, stop in runs)
    v.kept_outside = max(0, base.one.forward_end - base.kept)
    v.kept_per_layer = (forward_end - v.kept_outside) // L
    on_device = forward_end - sum(off[:max(0, L - in_flight)])  # the copies made by the forward's end
    v.head_transient = max(v.phases["head"], v.phases["loss backward"]) - on_device
    v.layer_transient = max(k.transient(("backward", 0)) for k in kinds.values())
    v.peak = base._line("weights")(L) + base._line("state")(L) + max(v.phases.values())
    return v


def _parts(layered, L):
    return {"weights": layered._line("weights")(L), "gradients": layered._line("grads")(L),
            "optimizer state": layered._line("state")(L)}


def _variants(proj, seq_len, names=VARIANTS):
    """{name: Variant} of the variants of `names` but "ours plan" (fit.plan's) at `seq_len`: memory only."""
    out = {}
    L = proj.num_layers
    for name in names:
        if name == "ours plan":
            continue
        if name.startswith("ours") and proj.model.ours_error():
            out[name] = Variant(name, error=proj.model.ours_error())
            continue
        kind = _SIMULATED.get(name) or _INPUTS_OFFLOADED[name]
        offloaded = {kind: _input_bytes(proj, seq_len)} if name in _INPUTS_OFFLOADED else None
        out[name] = _variant(name, {kind: proj.layered(kind, seq_len)}, [kind] * L, L, offloaded)
        if name == TRANSFORMERS_OFFLOADED:  # save_on_cpu copies every layer's input, the last one's too
            out[name].host += _input_bytes(proj, seq_len)
    return out


def _input_bytes(proj, seq_len):
    """Bytes of one layer's input, the residual stream in the weights' dtype (float32 under autocast and QLoRA)."""
    import torch

    size = torch.empty((), dtype=proj.model.form.weights).element_size()
    return proj.batch * seq_len * proj.model.config.hidden_size * size


def _form(form):
    form = form if form is not None else TrainingForm()
    if not isinstance(form, TrainingForm):
        raise TypeError(f"form must be a TrainingForm, got {type(form).__name__}")
    return form


# contexts of the two simulated steps the longest context is read from (past ours' loss-head chunk length)
_PROBES = (4096, 8192)
