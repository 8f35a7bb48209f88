"""The planner: for each decoder layer what it keeps, offloads and rebuilds, and the MLP's tiles, at the least
predicted step time that fits a GPU and a pinned host budget.

Candidates are keeping.LayerPolicy objects: each recompute mode ("none", "selective", "attention-kept", "full")
with any set of the classes it keeps offloaded (attention's outputs are never offloaded under "attention-kept"),
and for the modes that rebuild the MLP, the MLP in tiles of about a hidden size of tokens; under "full" also the
whole layer in such tiles (keeping.layer_tiles; not for mixtures of experts). A plan runs one policy
on its first k layers and another on the rest (the layers are alike, so two suffice), with the offload engine's
prefetch depth 1 or 2. The memory of each plan is the fit's projection of simulated steps (arithmetic.py: the
kinds a plan runs are simulated, the offloaded classes' bytes are the estimate's, which the ledger measures); its
time is the time model's (timing.py) with the rates of the device (rates.py). The search is exhaustive over the
candidates that no other beats on bytes kept on the device, host bytes and time at once: a fraction of a second.
"""

import dataclasses
import itertools

from .. import keeping
from ..keeping.policy import CHECKPOINTED
from ..memory.units import format_bytes
from . import timing
from .arithmetic import ALLOCATOR_SHARE, _fits, _Projection, _variant

MODES = ("none", "selective", "attention-kept", "full")
PREFETCH = (1, 2)
TOLERANCE = 0.02  # predicted times this close count as equal (the model is good to ~15 %, not to 2 %)
_SHORTLIST = 14  # candidates paired with each other (the fastest of those no other one dominates)


class PlanError(ValueError):
    """No plan fits: `gpu_bytes` and `host_bytes` the budgets, `min_gpu_bytes` the smallest GPU (with the allocator's
    share) any plan fits with `min_host_bytes` of host memory."""

    def __init__(self, message, min_gpu_bytes=None, min_host_bytes=None):
        super().__init__(message)
        self.min_gpu_bytes, self.min_host_bytes = min_gpu_bytes, min_host_bytes


class Plan(list):
    """A keeping.LayerPolicy per decoder layer (a list: `set_recompute(model, plan)` and `convert(model, plan=plan)`
    take it), with what the planner predicts:

    prefetch: the offload engine's reload depth; peak: GPU bytes at the step's peak (without the allocator's
    share); host_bytes: pinned host bytes the offloaded copies hold; step_seconds and tokens_per_second by the
    time model; times: the step's seconds by part; seq_len, batch, gpu_bytes, host_budget; rates: the Rates used.
    """

    def __init__(self, policies, **info):
        super().__init__(policies)
        for k, v in info.items():
            setattr(self, k, v)

    @property
    def policies(self):
        return list(self)

    def runs(self):
        """[(policy, layers)] in layer order."""
        return [(p, len(list(g))) for p, g in itertools.groupby(self)]

    def describe(self):
        """What the plan does, in a few words: '32 layers attention-kept, offload input, MLP in 8 tiles'."""
        return "; ".join(f"{n} layer{'s' if n > 1 else ''} {p.name()}" for p, n in self.runs())

    def __str__(self):
        lines = [f"plan at {self.batch} x {self.seq_len} tokens: {self.describe()}"]
        if any(p.offloaded for p in self):
            lines.append(f"  offload prefetch {self.prefetch}")
        lines.append(f"  GPU peak {format_bytes(self.peak * (1 + ALLOCATOR_SHARE))} (with the allocator's "
                     f"{ALLOCATOR_SHARE:.0%}) of {format_bytes(self.gpu_bytes)}; pinned host "
                     f"{format_bytes(self.host_bytes)} of {format_bytes(self.host_budget)}")
        lines.append(f"  step {self.step_seconds:.3f} s predicted, {self.tokens_per_second:,.0f} tokens/s "
                     f"(rates: {self.rates.device})")
        width = max(len(str(p)) for p in self)
        for i, p in enumerate(self):
            lines.append(f"  layer {i:>3}: {str(p):<{width}}  " + _actions(p))
        return "\n".join(lines)

    def __repr__(self):
        return f"Plan({self.describe()!r}, peak={self.peak}, host_bytes={self.host_bytes}, " \
               f"step_seconds={self.step_seconds:.4g})"


def _actions(p):
    parts = []
    for action in ("keep", "offload", "rebuild"):
        cls = [c for c in keeping.CLASSES if p.action(c) == action]
        if cls:
            parts.append(f"{action} {','.join(cls)}")
    return "; ".join(parts)


MIN_TILE = 1024  # tokens: below this a tile's fixed costs (a checkpoint, its RNG state) outweigh what it saves
MAX_TILES = 64  # each tile count is simulated on its own, at a cost that grows with the count; 64 tiles leave an
# MLP's intermediate a 64th of the context's, below the layer's other transients at any context


def default_tiles(tokens, hidden):
    """The MLP's tile count at `tokens` tokens: tiles of a quarter to one max(`hidden`, MIN_TILE) of tokens, a power
    of 4 (so that contexts near each other share a count, and its simulated steps), at most MAX_TILES; 1 below."""
    size = max(hidden, MIN_TILE)
    n = 1
    while n * size < tokens and n < MAX_TILES:
        n *= 4
    return n


def is_mixture_of_experts(config):
    """Whether the config's MLPs are mixtures of experts (which do not run in layer tiles)."""
    return any(getattr(config, a, None) for a in ("num_local_experts", "num_experts", "n_routed_experts",
                                                  "moe_num_experts"))


def has_recurrent_layers(config):
    """Whether some layers hold a recurrent token mixer (config.layer_types "linear_attention": a hybrid's Gated
    DeltaNet), which query tiles would restart (convert refuses layer tiles for them)."""
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def _tiled_kinds(mode, tiles, layer_tiles):
    """The simulated kinds of `mode`: untiled, its MLP in `tiles` tiles where it rebuilds the MLP, and under "full"
    the whole layer in `tiles` tiles where `layer_tiles`."""
    if mode not in CHECKPOINTED or tiles == 1:
        return (mode,)
    kinds = (mode, keeping.policy(mode, mlp_tiles=tiles))
    if mode == "full" and layer_tiles:
        kinds += (keeping.policy(mode, layer_tiles=tiles),)
    return kinds


def _tiles(kind, field):
    return getattr(kind, field) if isinstance(kind, keeping.LayerPolicy) else 1


@dataclasses.dataclass
class _Candidate:
    policy: keeping.LayerPolicy
    kind: object  # the simulated kind it runs as (its mode, with its tiles)
    to_host: int  # bytes a layer offloads
    first_to_host: int  # bytes the first layer offloads (its input is no activation it keeps unless checkpointed
    # or the embeddings train)
    forward: float
    backward: float  # the layer's backward with its rebuild


def _candidates(proj, seq_len, rates=None):
    """Every candidate policy at `seq_len`, with its layer's times by `rates` (None: memory only)."""
    model = proj.model
    tokens = proj.batch * seq_len
    cost = model.cost
    times = timing.layer_times(cost, rates, tokens, seq_len) if rates is not None else None
    tiles = default_tiles(tokens, cost.hidden)
    layer_tiles = tiles > 1 and not is_mixture_of_experts(model.config) and not has_recurrent_layers(model.config)
    out = []
    for mode in MODES:
        per_token = model.class_bytes(mode)
        base = keeping.resolve(mode)
        offloadable = [c for c in keeping.CLASSES if base.action(c) == "keep" and per_token.get(c)
                       and not (mode == "attention-kept" and c == "attention")]
        for kind in _tiled_kinds(mode, tiles, layer_tiles):
            for r in range(len(offloadable) + 1):
                for offload in itertools.combinations(offloadable, r):
                    policy = keeping.policy(mode, offload=list(offload), mlp_tiles=_tiles(kind, "mlp_tiles"),
                                            layer_tiles=_tiles(kind, "layer_tiles"))
                    to_host = int(sum(per_token[c] for c in offload) * tokens)
                    first = to_host
                    if "input" in offload and mode not in CHECKPOINTED and model.form.kind != "full":
                        first -= int(per_token["input"] * tokens)
                    if times is None:
                        out.append(_Candidate(policy, kind, to_host, first, 0.0, 0.0))
                    else:
                        out.append(_Candidate(policy, kind, to_host, first, timing.forward_time(times, policy),
                                              times.backward + timing.rebuild_time(times, policy)))
    return out


def uniform_candidates(proj, seq_len):
    """The Variant (memory only) of each candidate policy on every layer at `seq_len`, offload prefetch 1."""
    L = proj.num_layers
    out = []
    for c in _candidates(proj, seq_len):
        v = _variant("ours plan", {0: proj.layered(c.kind, seq_len)}, [0] * L, L, {0: c.to_host}, 1, c.first_to_host)
        v.modes = [c.policy] * L
        out.append(v)
    return out


def _evaluate(proj, seq_len, layout, prefetch, rates, head_and_optimizer, timed=True):
    """(Variant, seconds, (forward, backward seconds)) of `layout`: [(candidate, layers)] in layer order; with
    timed=False the Variant alone (whether a layout fits needs no time: the bisections ask only that)."""
    L = proj.num_layers
    modes, layered, offloaded = [], {}, {}
    for key, (cand, n) in enumerate(layout):  # keyed by position: hashing policies costs more than the rest
        modes += [key] * n
        layered[key] = proj.layered(cand.kind, seq_len)
        offloaded[key] = cand.to_host
    v = _variant("ours plan", layered, modes, L, offloaded, prefetch, layout[0][0].first_to_host)
    if not timed:
        return v
    v.modes = [cand.policy for cand, n in layout for _ in range(n)]
    forward = [cand.forward for cand, n in layout for _ in range(n)]
    backward = [cand.backward for cand, n in layout for _ in range(n)]
    to_host = [cand.to_host for cand, n in layout for _ in range(n)]
    to_host[0] = layout[0][0].first_to_host
    fwd, bwd = timing.offload_times(forward, backward, to_host, rates, prefetch)
    return v, fwd + bwd + head_and_optimizer, (fwd, bwd)


def search(proj, seq_len, gpu_bytes, host_bytes, rates, first_fit=False):
    """The fastest Plan for the model of `proj` (arithmetic._Projection) at `seq_len`; PlanError when none fits.
    `first_fit`: only whether a plan fits (True or False), answered at the first layout of the search that fits (the
    longest-context search asks only that)."""
    if not isinstance(proj, _Projection):
        raise TypeError(f"proj must be an arithmetic._Projection, got {type(proj).__name__}")
    L = proj.num_layers
    model = proj.model
    tokens = proj.batch * seq_len
    cost = model.cost
    fixed_time = timing.head_time(cost, rates, tokens, model.config.vocab_size) + timing.optimizer_time(cost, rates)
    cands = _candidates(proj, seq_len, rates)
    uniform = []
    for c in cands:
        for prefetch in (PREFETCH if c.to_host else (1,)):
            v, t, _ = _evaluate(proj, seq_len, [(c, L)], prefetch, rates, fixed_time)
            uniform.append((c, prefetch, v, t))
    fitting = []  # (seconds, host bytes, policies, peak, layout, prefetch, variant) of each plan that fits
    best = None

    def consider(layout, prefetch, v, t):
        nonlocal best
        if v.host <= host_bytes and _fits(v.peak, gpu_bytes):
            fitting.append((t, v.host, len(layout), v.peak, layout, prefetch, v))
            if best is None or t < best[0][0]:
                best = ((t,), layout, prefetch, v)

    for c, prefetch, v, t in uniform:
        consider([(c, L)], prefetch, v, t)
    if first_fit and best is not None:
        return True
    # pairs: a candidate faster than the best uniform plan (too big alone) on some layers, another on the rest,
    # both among those no other candidate beats on device bytes, host bytes and time at once
    items = [(c, v.peak, v.host, t) for c, prefetch, v, t in uniform if prefetch == 1]
    # the shortlist: those no other candidate beats on device bytes and time (host bytes aside: a plan may hold
    # few layers of a copying one), the same among those that copy nothing, and the fastest of those none beats
    # on all three
    short = {id(x[0]): x for x in _pareto([(c, peak, 0, t) for c, peak, _, t in items])}
    short.update({id(x[0]): x for x in _pareto([x for x in items if not x[2]])})  # those that copy nothing
    short.update({id(x[0]): x for x in sorted(_pareto(items), key=lambda x: x[3])[:_SHORTLIST]})
    short = list(short.values())
    limit = best[0][0] if best is not None else float("inf")
    fast = [x for x in short if x[3] < limit]
    small = short
    for (f, *_), (m, *_) in itertools.product(fast, small):
        if f is m:
            continue
        for f_first, prefetch in itertools.product((True, False), PREFETCH if f.to_host or m.to_host else (1,)):
            def layout(k, f=f, m=m, f_first=f_first):  # k layers of the faster one, first or last
                return [(f, k), (m, L - k)] if f_first else [(m, L - k), (f, k)]

            def fits(k, layout=layout, prefetch=prefetch):
                v = _evaluate(proj, seq_len, layout(k), prefetch, rates, fixed_time, timed=False)
                return v.host <= host_bytes and _fits(v.peak, gpu_bytes)

            # as many layers of the faster one as fit: more of the larger one hold more (bisection)
            lo, hi = 0, L  # lo fits (or is 0), hi does not (or is L)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            for k in {lo, hi} - {0, L}:
                v, t, _ = _evaluate(proj, seq_len, layout(k), prefetch, rates, fixed_time)
                consider(layout(k), prefetch, v, t)
                if first_fit and best is not None:
                    return True
    if first_fit:
        return False
    if best is None:
        least = min(uniform, key=lambda u: (u[2].peak, u[2].host))
        need_gpu = int(least[2].peak * (1 + ALLOCATOR_SHARE)) + 1
        raise PlanError(
            f"no plan fits {format_bytes(gpu_bytes)} of GPU memory with {format_bytes(host_bytes)} of pinned host "
            f"memory at {proj.batch} x {seq_len} tokens: the least GPU memory any plan needs is "
            f"{format_bytes(need_gpu)} ({least[0].policy.name()} on every layer, with "
            f"{format_bytes(least[2].host)} of host memory); a larger --gpu/--host, a shorter context or a smaller "
            "batch fits", need_gpu, least[2].host)
    # plans within TOLERANCE of the fastest are as fast as the time model can tell: of those, the one that copies
    # the least, then runs one policy, then is fastest
    fastest = best[0][0]
    t, _, _, _, layout, prefetch, v = min((f for f in fitting if f[0] <= fastest * (1 + TOLERANCE)),
                                          key=lambda f: (f[1], f[2], f[0], f[3]))
    _, _, (fwd, bwd) = _evaluate(proj, seq_len, layout, prefetch, rates, fixed_time)
    policies = [c.policy for c, n in layout for _ in range(n)]
    if layout[-1][1] == 1 and policies[-1].offloaded:  # the last layer's copy is never issued: it keeps
        policies[-1] = keeping.policy(policies[-1].recompute, mlp_tiles=policies[-1].mlp_tiles,
                                      layer_tiles=policies[-1].layer_tiles)
    times = {"forward": fwd, "backward": bwd, "loss head": timing.head_time(cost, rates, tokens,
                                                                          model.config.vocab_size),
             "optimizer": timing.optimizer_time(cost, rates)}
    return Plan(policies, prefetch=prefetch, peak=v.peak, host_bytes=v.host, step_seconds=t,
                tokens_per_second=tokens / t, times=times, seq_len=seq_len, batch=proj.batch, gpu_bytes=gpu_bytes,
                host_budget=host_bytes, rates=rates, variant=v)


def _pareto(items):
    """Items (candidate, device bytes, host bytes, seconds) that no other item beats on all three."""
    out = []
    for it in items:
        if not any(o is not it and o[1] <= it[1] and o[2] <= it[2] and o[3] <= it[3] and
                   (o[1], o[2], o[3]) != (it[1], it[2], it[3]) for o in items):
            out.append(it)
    return out
