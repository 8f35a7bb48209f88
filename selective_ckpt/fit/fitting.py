"""fit(): the projection of arithmetic.py at a context, the longest context of each variant, the time of each by
the time model (timing.py, rates.py) and the planner's plan (plan.py) for a GPU and a pinned host budget."""

import collections
import dataclasses

import torch
from torch import nn

from .. import compat, keeping
from ..validation import check_positive_int
from . import timing
from .arithmetic import (
    _GROUPS,
    _PROBES,
    _SIMULATED,
    ALLOCATOR_SHARE,
    NOT_MODELLED,
    TRANSFORMERS_OFFLOADED,
    VARIANTS,
    BudgetError,
    Variant,
    _fits,
    _form,
    _group,
    _input_bytes,
    _Model,
    _parts,
    _Projection,
    _variants,
)
from .cards import default_host_bytes, is_card, parse_bytes
from .configs import load_config, require
from .forms import TrainingForm
from .planner import PlanError, search, uniform_candidates
from .rates import Rates, rates_for


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
    host_bytes: int = None  # the pinned host budget (None: no limit)
    rates: Rates = None  # the rates the step times are predicted with
    plan: object = None  # the planner's Plan at seq_len (fit.plan.Plan), or None when no plan fits
    _projection: object = dataclasses.field(default=None, repr=False, compare=False)

    def fits(self, name):
        v = self.variants[name]
        return v.error is None and _fits(v.peak, self.gpu_bytes) and _host_fits(v.host, self.host_bytes)

    def at(self, name, seq_len):
        """The Variant `name` at another context, from the same simulated steps (the projection the longest
        contexts come from): simulated where one was, else linear between the nearest simulated contexts."""
        if name not in VARIANTS:
            raise ValueError(f"name must be one of {VARIANTS}, got {name!r}")
        check_positive_int(seq_len, "seq_len")
        return variants(self._projection, seq_len, self.gpu_bytes, self.host_bytes, self.rates, names=(name,))[name]

    def fits_at(self, name, seq_len):
        """Whether `name` fits the GPU (and the host budget) at `seq_len` by the projection (`at`)."""
        v = self.at(name, seq_len)
        return v.error is None and _fits(v.peak, self.gpu_bytes) and _host_fits(v.host, self.host_bytes)


def _host_fits(host, budget):
    return budget is None or host <= budget


# the policy each variant's layers run, for the time model
_POLICIES = {"transformers": "none", "transformers + gradient checkpointing": "full",
             TRANSFORMERS_OFFLOADED: "full", "ours none": "none", "ours selective": "selective", "ours full": "full",
             "ours attention-kept": "attention-kept",
             "ours full, inputs offloaded": keeping.policy("full", offload=["input"]),
             "ours attention-kept, inputs offloaded": keeping.policy("attention-kept", offload=["input"])}


def _timed(proj, seq_len, v, rates):
    """Sets v's step time and tokens/s by the time model: its policy on every layer; transformers' offloaded
    checkpointing copies each layer's input on the compute stream (save_on_cpu), so its copies add their time."""
    if v.error is not None:
        return v
    model = proj.model
    tokens = proj.batch * seq_len
    t = timing.layer_times(model.cost, rates, tokens, seq_len)
    p = keeping.resolve(_POLICIES[v.name])
    L = proj.num_layers
    to_host = _input_bytes(proj, seq_len) if p.offloaded else 0
    backward = t.backward + timing.rebuild_time(t, p)
    if v.name == TRANSFORMERS_OFFLOADED:
        copy = _input_bytes(proj, seq_len)
        fwd = L * (t.forward + copy / rates.device_to_host)
        bwd = L * (backward + copy / rates.host_to_device)
    else:
        fwd, bwd = timing.offload_times([t.forward] * L, [backward] * L, [to_host] * L, rates)
    v.step_seconds = fwd + bwd + timing.head_time(model.cost, rates, tokens, model.config.vocab_size) + \
        timing.optimizer_time(model.cost, rates)
    v.tokens_per_second = tokens / v.step_seconds
    return v


def plan_at(proj, seq_len, gpu_bytes, host_bytes, rates):
    """(Plan or None, the "ours plan" Variant) at `seq_len`."""
    if proj.model.ours_error():
        return None, Variant("ours plan", error=proj.model.ours_error())
    try:
        p = search(proj, seq_len, gpu_bytes, float("inf") if host_bytes is None else host_bytes, rates)
    except PlanError as err:
        return None, Variant("ours plan", error=str(err), unfit=True)
    v = p.variant
    v.step_seconds, v.tokens_per_second = p.step_seconds, p.tokens_per_second
    return p, v


def variants(proj, seq_len, gpu_bytes=None, host_bytes=None, rates=None, names=VARIANTS):
    """{name: Variant} at `seq_len`, each with its predicted step time (`rates`: None leaves them out); "ours
    plan" needs the budgets."""
    out = _variants(proj, seq_len, names)
    if rates is not None:
        for v in out.values():
            _timed(proj, seq_len, v, rates)
    if "ours plan" in names and gpu_bytes is not None and rates is not None:
        out["ours plan"] = plan_at(proj, seq_len, gpu_bytes, host_bytes, rates)[1]
    return out


def predict(config, batch, seq_len, form=None, names=VARIANTS, rates=None):
    """{variant name: Variant} (its `peak` and `phases` in bytes, and with `rates` (a card name or Rates) its
    predicted step time) of one step at `batch` x `seq_len`; "ours plan" needs a budget (fit) and is left out."""
    check_positive_int(batch, "batch")
    check_positive_int(seq_len, "seq_len")
    form = _form(form)
    if form.kind != "full":
        require("peft")
    proj = _Projection(_Model(load_config(config), form), batch)
    proj.simulate(seq_len)
    return variants(proj, seq_len, rates=None if rates is None else rates_for(rates),
                    names=tuple(n for n in names if n != "ours plan"))


# with seq_len "max": at most this many more contexts simulated near the answer, so that its figures are a
# simulation's (each such step moves the line the answer is read from closer to the steps there)
_ROUNDS = 3
# simulated steps of the last configs and forms fit() saw (a few MiB at most): asking again, for another
# budget or context, reads the same steps
_CACHE = collections.OrderedDict()
_CACHE_SIZE = 4


def _model(config, form):
    key = (config.to_json_string(use_diff=False), form,
           compat.requested_attention_implementation(config), compat.requested_experts_implementation(config))
    if key not in _CACHE:
        _CACHE[key] = _Model(config, form)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    return _CACHE[key]


def fit(config, gpu_bytes, batch=1, seq_len="max", form=None, host_bytes=None, rates=None, context_limit=None):
    """Projects one training step's peak memory for `config` (load_config's input) on a GPU of
    `gpu_bytes`, per variant (VARIANTS), its predicted step time, and the longest context per sample that fits
    each; "ours plan" is the planner's (fit.plan): per layer what is kept, offloaded and rebuilt, at the least
    predicted time that fits.

    `seq_len`: tokens per sample, or "max" (the report is then at the longest context the plan fits, else
    the longest any variant fits). `form`: a TrainingForm (default: full fine-tune, AdamW, float32).
    `host_bytes`: pinned host memory the offloading variants may use (None: no limit). `rates`: the device's
    rates for the time model (a card name of fit.rates.RATES, a Rates; None: the H200's). `context_limit`: the
    longest context the search tries (None: the config's max_position_embeddings; RoPE scaling trains past it).

    The longest contexts fit by construction: each is the largest context at which the projection (the
    simulated steps where there is one, else the line through the nearest simulated contexts; Fit.at) fits,
    the next one not (or the config's max_position_embeddings). Raises BudgetError (a ValueError) when the
    GPU holds less than the weights and optimizer state alone. The simulated steps of the last few configs
    and forms are kept, so another budget or context of the same config and form costs no simulation there.
    """
    config = load_config(config)
    form = _form(form)
    if form.kind != "full":
        require("peft")
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) or gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be a positive number of bytes, got {gpu_bytes!r}")
    if host_bytes is not None and (isinstance(host_bytes, bool) or not isinstance(host_bytes, (int, float)) or
                                   host_bytes < 0):
        raise ValueError(f"host_bytes must be a non-negative number of bytes or None, got {host_bytes!r}")
    rates = rates_for(rates)
    check_positive_int(batch, "batch")
    if seq_len != "max":
        check_positive_int(seq_len, "seq_len")
    asked = seq_len
    proj = _Projection(_model(config, form), batch)
    fixed = _fixed(proj)
    if fixed >= gpu_bytes:
        raise BudgetError(gpu_bytes, fixed, form)
    limit = context_limit or getattr(config, "max_position_embeddings", None) or 1 << 20
    check_positive_int(limit, "context_limit")
    if seq_len != "max":
        proj.simulate(seq_len)
    budgets = (gpu_bytes, host_bytes)
    max_context, sources = _longest_all(proj, budgets, limit, rates)
    if seq_len == "max":
        named = [n for n in VARIANTS if n != "ours plan"]
        target = "ours plan" if max_context["ours plan"] else max(named, key=max_context.get)
        group = (_group(_SIMULATED[target]),) if target in _SIMULATED else tuple(_GROUPS)
        for _ in range(_ROUNDS):
            at = max(1, max_context[target])
            if proj.simulated(at, group):
                break
            proj.simulate(at, group)
            max_context, sources = _longest_all(proj, budgets, limit, rates)
        seq_len = max(1, max_context[target])
        if not proj.simulated(seq_len):  # the other rows at the same context, simulated too
            proj.simulate(seq_len, tuple(g for g in _GROUPS if g not in group or not proj.simulated(seq_len, (g,))))
            max_context, sources = _longest_all(proj, budgets, limit, rates)
            seq_len = max(1, max_context[target])
    found = variants(proj, seq_len, rates=rates, names=tuple(n for n in VARIANTS if n != "ours plan"))
    plan, found["ours plan"] = plan_at(proj, seq_len, gpu_bytes, host_bytes, rates)
    ok = next(v for v in found.values() if v.error is None)
    kind = "transformers" if ok.name.startswith("transformers") else "selective"
    parts = _parts(proj.layered(kind, seq_len), proj.num_layers)
    return Fit(config.model_type, form, batch, seq_len, int(gpu_bytes), proj.num_layers, parts, found,
               max_context, max_context_from=sources, source=_source(proj, seq_len), seq_len_asked=asked,
               host_bytes=host_bytes, rates=rates, plan=plan, _projection=proj)


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


def _longest_all(proj, budgets, limit, rates=None):
    """({name: longest context that fits}, {name: the variant it is read from, where another})."""
    out, sources = {}, {}
    for name in VARIANTS:
        if name != "ours plan":
            out[name] = _longest(proj, name, budgets, limit)
    out["ours plan"] = _longest_plan(proj, budgets, limit, max(v for k, v in out.items() if k.startswith("ours")),
                                     rates)
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


def _longest(proj, name, budgets, limit):
    """Longest context per sample whose projected peak (with the allocator's share) fits, and its host copies the
    host budget, 0 if none: the line's guess, then checked against the projection itself, a step at a time
    outwards and halving back in, until the answer fits and the next context does not (or the answer is `limit`)."""
    gpu_bytes, host_bytes = budgets
    if _variants(proj, _PROBES[0], names=(name,))[name].error is not None:
        return 0

    def fits(s):
        v = _variants(proj, s, names=(name,))[name]
        return _fits(v.peak, gpu_bytes) and _host_fits(v.host, host_bytes)

    return _search(fits, _guess(proj, name, gpu_bytes, limit), limit)


def _longest_plan(proj, budgets, limit, known, rates=None):
    """The plan's longest context: the longest at which any policy on every layer fits (a plan holds at least
    what its leanest policy alone does), at least `known` (the longest of ours' variants, each a plan); then, with
    `rates`, the longest at which the planner finds a plan, which mixes policies (where the host budget ends the
    leanest policy, some layers keep their inputs on the GPU)."""
    if proj.model.ours_error():
        return 0
    gpu_bytes, host_bytes = budgets

    def fits(s):
        return any(_fits(v.peak, gpu_bytes) and _host_fits(v.host, host_bytes)
                   for v in uniform_candidates(proj, s))

    longest = known
    if known < limit and fits(known + 1):
        longest = _search(fits, known + 1, limit)
    if rates is None or longest >= limit or longest == 0:
        return longest
    host = float("inf") if host_bytes is None else host_bytes
    return _search(lambda s: search(proj, s, gpu_bytes, host, rates, first_fit=True), longest + 1, limit)


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


def plan(model_or_config, gpu, host=None, batch=1, seq_len=None, form=None, autocast=None, rates=None):
    """The fastest per-layer plan for training `model_or_config` on a GPU of `gpu` with `host` of pinned host
    memory, at `batch` x `seq_len` tokens (fit.planner.Plan: a keeping.LayerPolicy per decoder layer, with the
    offload prefetch, predicted GPU peak, host bytes, step time and tokens/s; print it to see each layer).

    model_or_config: a transformers causal LM (also under PEFT, converted or not: its config and training form
    are read from it: LoRA's rank, targets and dropout, QLoRA's 4-bit bases, the weights' dtype), or a config as
    fit takes it (a bundled name, a config.json path, a PretrainedConfig) with `form` (fit.TrainingForm).
    gpu / host: bytes, or what --gpu and --host take ("H100-80GB", "80GB", "256GiB"); host None: half of this
    machine's memory. autocast: the dtype autocast computes in (a model's form cannot tell). rates: a card name
    of fit.RATES or a Rates (fit.probe() measures the device at hand); None: the card `gpu` names, else the
    H200's. Apply it with selective_ckpt.set_recompute(model, plan) or convert(model, plan=plan).

    Raises PlanError (a ValueError) naming the least GPU memory any plan needs when none fits.
    """
    check_positive_int(batch, "batch")
    check_positive_int(seq_len, "seq_len")
    gpu_bytes = parse_bytes(gpu) if isinstance(gpu, str) else gpu
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) or gpu_bytes <= 0:
        raise ValueError(f"gpu must be a positive number of bytes or a size or card name ('80GB', 'H100-80GB'), "
                         f"got {gpu!r}")
    host_bytes = parse_bytes(host, "--host") if isinstance(host, str) else host
    if host_bytes is None:
        host_bytes = default_host_bytes()
    if isinstance(host_bytes, bool) or not isinstance(host_bytes, (int, float)) or host_bytes < 0:
        raise ValueError(f"host must be a non-negative number of bytes or a size ('256GB'), got {host!r}")
    if rates is None and isinstance(gpu, str) and is_card(gpu):
        rates = gpu
    rates = rates_for(rates)
    if isinstance(model_or_config, nn.Module):
        if form is not None:
            raise ValueError("form is read from the model; pass form only with a config")
        config, form = form_of(model_or_config, autocast)
    else:
        config = load_config(model_or_config)
        form = _form(form)
        if autocast is not None:
            form = dataclasses.replace(form, autocast=autocast)
    if form.kind != "full":
        require("peft")
    proj = _Projection(_model(config, form), batch)
    proj.simulate(seq_len)
    return search(proj, seq_len, gpu_bytes, float("inf") if host_bytes is None else host_bytes, rates)


def form_of(model, autocast=None):
    """(config, TrainingForm) of a transformers model as it trains: LoRA adapters (PEFT's lora_A) give kind "lora"
    with their rank, targets and dropout, 4-bit bases (bitsandbytes' Linear4bit) "qlora"; the weights' dtype is
    the embedding's."""
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(root, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise TypeError(f"model must be a transformers causal LM (or one under PEFT), got {type(model).__name__}")
    config = config.__class__.from_dict(config.to_dict())
    kind, rank, targets, dropout = "full", 16, None, 0.0
    for name, m in model.named_modules():
        if compat.is_4bit(m):
            kind = "qlora"
        lora_a = getattr(m, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and len(lora_a):
            adapter = next(iter(lora_a))
            rank = m.r[adapter]
            targets = (targets or ()) + (name.rsplit(".", 1)[-1],)
            drop = m.lora_dropout[adapter]
            dropout = max(dropout, float(getattr(drop, "p", 0.0)))
    if targets is None and kind == "qlora":
        raise ValueError("model has 4-bit bases but no LoRA adapters: a 4-bit base cannot be trained")
    if targets is not None and kind == "full":
        kind = "lora"
    emb = root.get_input_embeddings().weight
    weights = torch.float32 if kind == "qlora" else emb.dtype
    form = TrainingForm(kind, weights=weights, autocast=autocast, rank=rank,
                        targets=tuple(dict.fromkeys(targets)) if targets else TrainingForm().targets,
                        lora_dropout=dropout)
    return config, form
