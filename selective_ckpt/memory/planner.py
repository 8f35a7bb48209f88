"""The planner: a recompute mode per layer that fits a memory budget with the least recompute cost."""

import dataclasses
import functools
from collections import OrderedDict

import torch
from torch import nn

from ..keeping.policy import CHECKPOINTED, resolve
from ..registry import recomputable_layers, state_of
from ..validation import GATED_ACTIVATIONS, check_positive_int
from ..validation import RECOMPUTE_MODES as MODES
from .estimate import check_shape, estimate, recompute_flops
from .parts import layer_of
from .units import as_dtype, format_bytes


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A decoder layer as the planner sees it: its widths and dtype, and its parts (memory/parts.py), whose kept
    bytes `estimate` sums."""

    hidden_dim: int
    num_heads: int
    mlp_ratio: float = 4
    dtype: torch.dtype = torch.float32
    causal: bool = True
    # The layer's keyword-only shape arguments (Llama-style layers); None / defaults = GPT-style.
    num_kv_heads: int = None
    ffn_dim: int = None
    norm: str = "layernorm"
    activation: str = "gelu"
    sliding_window: int = None
    head_dim: int = None  # the attention's head width where heads x head_dim is not hidden_dim (gpt-oss, Gemma)
    # whether the layer's norms keep their statistics (False: norms that run their own forward again in backward),
    # a fact of every norm it holds (residual, q/k, post- and latent norms), so of the layer, not of one part
    norm_stats: bool = True
    # The layer's parts in the order they keep: a Residual, its attention (Attention, MLA) or none, a Mixer, its MLP
    # (DenseMLP, MoE), Scalars, then parts of other forms. Without a Residual the parts given follow those of a
    # plain layer of `activation` (memory.estimate's `parts`); either way, `parts` holds the whole layer.
    parts: tuple = ()

    def __post_init__(self):
        layer = layer_of(tuple(self.parts), self.activation in GATED_ACTIVATIONS)
        object.__setattr__(self, "parts", tuple(layer))

    def part(self, cls):
        """The layer's part of class `cls` (or a subclass: memory.MoE finds Llama4MoE), or None."""
        return next((p for p in self.parts if isinstance(p, cls)), None)

    def layer_kwargs(self):
        return {"num_kv_heads": self.num_kv_heads, "ffn_dim": self.ffn_dim, "norm": self.norm,
                "activation": self.activation, "sliding_window": self.sliding_window,
                "head_dim": self.head_dim}


class Plan(list):
    """A recompute mode per layer (a list, so `set_recompute(model, plan)` takes it as is), with:

    cost_flops: total extra backward FLOPs; kept_bytes: activations kept for backward;
    peak_bytes: kept_bytes plus the re-run working set (see `plan`); budget_bytes;
    max_batch: {mode: largest batch that fits the budget with every layer in that mode}.
    """

    def __init__(self, modes, cost_flops, kept_bytes, peak_bytes, budget_bytes, max_batch):
        super().__init__(modes)
        self.cost_flops = cost_flops
        self.kept_bytes = kept_bytes
        self.peak_bytes = peak_bytes
        self.budget_bytes = budget_bytes
        self.max_batch = max_batch

    @property
    def modes(self):
        return list(self)

    def __repr__(self):
        return (f"Plan({list(self)}, cost_flops={self.cost_flops}, kept_bytes={self.kept_bytes}, "
                f"peak_bytes={self.peak_bytes}, budget_bytes={self.budget_bytes}, max_batch={self.max_batch})")


def _layers_of(model_or_shape, num_layers):
    if isinstance(model_or_shape, nn.Module):
        # In module order, as set_recompute walks them (registry.recomputable_layers): our layers and
        # converted Hugging Face decoder layers, each giving its own shape.
        layers = recomputable_layers(model_or_shape)
        if not layers:
            raise ValueError("model_or_shape holds no SelectiveDecoderLayer or converted decoder layer")
        if num_layers is not None and num_layers != len(layers):
            raise ValueError(f"num_layers={num_layers} but the model holds {len(layers)} decoder layers")
        return [LayerShape(**state_of(m).shape()) for m in layers]
    if isinstance(model_or_shape, LayerShape):
        shape = model_or_shape
    elif isinstance(model_or_shape, dict):
        d = dict(model_or_shape)
        num_layers = d.pop("num_layers", num_layers)
        try:
            shape = LayerShape(**d)
        except TypeError as err:
            raise ValueError(f"model_or_shape dict: {err}; keys are hidden_dim, num_heads, mlp_ratio, dtype, "
                             "causal, num_kv_heads, ffn_dim, norm, activation, sliding_window, head_dim, "
                             "norm_stats, parts, num_layers") from None
    else:
        raise TypeError("model_or_shape must be a model holding SelectiveDecoderLayers, a LayerShape or a dict "
                        f"with hidden_dim, num_heads, num_layers (...), got {type(model_or_shape).__name__}")
    if num_layers is None:
        raise ValueError("num_layers is required when model_or_shape is a shape")
    check_positive_int(num_layers, "num_layers")
    shape = dataclasses.replace(shape, dtype=as_dtype(shape.dtype))
    check_shape(shape.hidden_dim, shape.num_heads, shape.mlp_ratio, **shape.layer_kwargs())
    return [shape] * num_layers


def _layer_figures(shape, batch, seq_len, modes=MODES):
    """{mode or policy: (device bytes kept, re-run working set, cost)} for one layer; what a policy offloads
    is in host memory and does not count against the device budget."""
    kw = shape.layer_kwargs()
    est = functools.partial(estimate, shape.hidden_dim, shape.num_heads, seq_len, batch, shape.dtype, shape.mlp_ratio,
                            norm_stats=shape.norm_stats, parts=shape.parts, **kw)
    cost = functools.partial(recompute_flops, shape.hidden_dim, shape.num_heads, seq_len, batch, shape.mlp_ratio,
                             causal=shape.causal, **kw)
    # a checkpointed layer's re-run keeps its selective set again, once, beyond what the checkpoint kept
    rerun = {m: est("selective") - est(m) for m in CHECKPOINTED}

    def device(m):
        return sum(v["device"] for v in est(m, breakdown="class").values())
    return {m: (device(m), rerun.get(resolve(m).recompute, 0), cost(resolve(m).recompute)) for m in modes}


def plan(model_or_shape, batch, seq_len, budget_bytes, *, num_layers=None, modes=MODES):
    """Recompute mode per layer fitting `budget_bytes` of activations with the least recompute cost.

    model_or_shape: a model holding SelectiveDecoderLayers or a converted Hugging Face model (the
    layers' shapes and dtype are read from it), or a LayerShape / dict(hidden_dim, num_heads,
    mlp_ratio=4, dtype=float32, causal=True, num_layers, and for Llama-style layers num_kv_heads,
    ffn_dim, norm, activation, sliding_window) for a model not built yet.

    Memory model: the activations kept for backward (`estimate` per layer and mode, summed over
    layers), plus, when any layer is "full" or "attention-kept", the largest such layer's re-run working
    set: its backward re-runs its forward, which keeps the layer's "selective" set again (beyond what the
    checkpoint kept) until that layer's backward is done (counted once: layers run backward one at a time).
    Weights, gradients, optimizer state and kernel workspaces are not in it: leave room for them in the budget.

    Cost model (`recompute_flops`): none = 0; selective = its elementwise recompute (two LayerNorm
    outputs and the GELU output, ~10 FLOPs per element: well under 1 % of a forward); full = one
    more forward of the layer (matmuls, attention, elementwise). The plan minimises the summed
    cost; ties go to fewer kept bytes. Full layers are placed first, since their re-run happens
    last in backward, when the fewest activations are still kept.

    `modes` may hold keeping.LayerPolicy objects (e.g. keeping.policy("selective", offload=["mlp"])): what a
    policy offloads is held in host memory, not against the budget (an offloaded layer still holds its
    tensors on the device until the next layer's forward has begun: the budget's margin must cover one layer).

    Returns a Plan (a list of modes, one per layer, plus cost_flops, kept_bytes, peak_bytes and
    max_batch: the largest batch that fits with every layer in one mode, per mode). An infeasible
    budget raises ValueError stating the minimum.
    """
    check_positive_int(batch, "batch")
    check_positive_int(seq_len, "seq_len")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}")
    modes = tuple(modes)
    if not modes:
        raise ValueError("modes must name at least one recompute mode")
    for m in modes:
        resolve(m, "modes")
    shapes = _layers_of(model_or_shape, num_layers)

    # Group identical layers: within a group only the counts per mode matter.
    groups = OrderedDict()
    for i, s in enumerate(shapes):
        groups.setdefault(s, []).append(i)

    # Exact search over per-group mode counts; states (kept, working set) -> (cost, choice per group),
    # with dominated states (more bytes, more working set and more cost) pruned.
    states = {(0, 0): (0, ())}
    for shape, idx in groups.items():
        fig = _layer_figures(shape, batch, seq_len, modes)
        n = len(idx)
        new = {}
        for (kept, work), (cost, choice) in states.items():
            for counts in _compositions(n, len(modes)):
                k = kept + sum(c * fig[m][0] for c, m in zip(counts, modes))
                w = max([work] + [fig[m][1] for c, m in zip(counts, modes) if c])
                cst = cost + sum(c * fig[m][2] for c, m in zip(counts, modes))
                if k + w > budget_bytes:
                    continue
                key = (k, w)
                if key not in new or cst < new[key][0]:
                    new[key] = (cst, choice + (counts,))
        states = _pareto(new)
        if not states:
            break

    max_batch = {m: _max_batch(shapes, seq_len, budget_bytes, m) for m in modes}
    if not states:
        floor = min(_peak(shapes, batch, seq_len, [m] * len(shapes)) for m in modes)
        best = min(modes, key=lambda m: _peak(shapes, batch, seq_len, [m] * len(shapes)))
        raise ValueError(
            f"budget_bytes={int(budget_bytes)} ({format_bytes(budget_bytes)}) cannot hold {len(shapes)} layers at "
            f"batch={batch}, seq_len={seq_len}: the minimum is {floor} bytes ({format_bytes(floor)}), every layer "
            f"{best!r}; largest batch per mode at this budget: {max_batch}")
    (kept, work), (cost, choice) = min(states.items(), key=lambda kv: (kv[1][0], kv[0][0] + kv[0][1]))
    out = [None] * len(shapes)
    # full layers first (their re-run comes last in backward), then by what they keep
    order = sorted(modes, key=lambda m: ("full", "attention-kept", "selective", "none").index(resolve(m).recompute))
    for idx, counts in zip(groups.values(), choice):
        per_mode = dict(zip(modes, counts))
        seq = [m for m in order for _ in range(per_mode[m])]
        for i, m in zip(idx, seq):
            out[i] = m
    return Plan(out, cost, kept, kept + work, int(budget_bytes), max_batch)


def _compositions(n, k):
    """All k-tuples of non-negative ints summing to n."""
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


def _pareto(states):
    items = sorted(states.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[1][0]))
    kept = {}
    for key, val in items:
        if any(k[0] <= key[0] and k[1] <= key[1] and v[0] <= val[0] for k, v in kept.items()):
            continue
        kept[key] = val
    return kept


def _peak(shapes, batch, seq_len, modes):
    figs = [_layer_figures(s, batch, seq_len, set(modes)) for s in shapes]
    return sum(f[m][0] for f, m in zip(figs, modes)) + max(f[m][1] for f, m in zip(figs, modes))


def _max_batch(shapes, seq_len, budget_bytes, mode):
    """Largest batch with every layer in `mode` under the budget (0 if batch 1 does not fit)."""
    per_sample = _peak(shapes, 1, seq_len, [mode] * len(shapes))  # everything is linear in batch
    return int(budget_bytes // per_sample)
