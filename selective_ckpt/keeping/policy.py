"""What a decoder layer keeps, per class of tensor: keep it on the device, offload it to host memory, or rebuild it.

A decoder layer's forward keeps tensors of a few classes for backward:

- "input": the layer input x (the first norm's input; all that whole-layer recompute keeps);
- "qkv": q, k, v as attention keeps them (after RoPE), and the q/k projection outputs a q/k norm keeps;
- "attention": attention's output o and its row logsumexp;
- "residual": x1 = x + attention branch (the second norm's input) and other norm inputs on the residual path
  (the post-norms' inputs: o_proj's and down_proj's outputs);
- "mlp": the MLP's matmul outputs (gate and up, or fc1; a mixture of experts' routed gate and up rows);
- "norm_act": norm and activation outputs (and the copies consumers make of them): elementwise, cheap to rebuild.

Anything else a layer keeps (norm statistics, dropout seeds, LoRA's rank-sized outputs, a router's probabilities)
is small, of class "other", and always kept. A `LayerPolicy` gives each class an action. The recompute modes are
named policies: "none" keeps everything, "selective" rebuilds the norm and activation outputs, "full" keeps the
layer input only and runs the layer again in backward, "attention-kept" keeps the layer input and attention's
output and logsumexp and runs the layer again in backward except attention's forward (keeping.attention_kept):
at long context, where attention's forward is most of a layer's, the cheapest way to keep little. Under "full" the
layer can also run in query tiles (`layer_tiles`, keeping.layer_tiles), so that its forward and rebuild hold one
tile's transients instead of the whole sequence's. Offloading is
orthogonal: any kept class can be offloaded instead (`policy("selective", offload=["mlp"])`). Which classes can
be rebuilt together is decided by the mechanisms that exist; any other combination is a ValueError naming it.
"""

import dataclasses
import functools

from ..validation import RECOMPUTE_MODES, check_mode

CLASSES = ("input", "qkv", "attention", "residual", "mlp", "norm_act")
OTHER = "other"  # small tensors of no class: always kept on the device
ACTIONS = ("keep", "offload", "rebuild")

# The rebuild sets the mechanisms implement, and the recompute mode that implements each.
_REBUILDS = {frozenset(): "none", frozenset({"norm_act"}): "selective", frozenset(CLASSES) - {"input"}: "full",
             frozenset(CLASSES) - {"input", "attention"}: "attention-kept"}
# Modes that run the layer again in backward (a checkpoint around it): what they keep is the checkpoint's.
CHECKPOINTED = ("full", "attention-kept")

# memory.estimate's parts by class (every other part is "other").
PART_CLASSES = {
    "x": "input",
    "qkv": "qkv", "qk_norm_in": "qkv",
    "o": "attention", "lse": "attention",
    "x1": "residual", "attn_out": "residual", "mlp_out": "residual",
    "gate_out": "mlp", "up_out": "mlp", "fc1_out": "mlp", "expert_gate_up": "mlp", "shared_gate_out": "mlp",
    "shared_up_out": "mlp",
    "ln1_out": "norm_act", "ln2_out": "norm_act", "qk_norm_out": "norm_act", "product": "norm_act",
    "gelu_out": "norm_act",
    "shared_product": "norm_act", "shared_scaled": "norm_act",
}


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """One action ("keep", "offload", "rebuild") per class of tensor (see the module doc)."""

    input: str = "keep"
    qkv: str = "keep"
    attention: str = "keep"
    residual: str = "keep"
    mlp: str = "keep"
    norm_act: str = "rebuild"
    # The MLP runs in this many sequence tiles, each rebuilt and differentiated on its own in backward, so its
    # transients are a tile's (keeping.tiling); only where the MLP is rebuilt anyway ("full", "attention-kept").
    mlp_tiles: int = 1
    # The whole layer runs over this many query tiles, in forward and in its rebuild (keeping.layer_tiles): k and v
    # for every token first, then each tile's queries, attention, out-projection and MLP; only under "full".
    layer_tiles: int = 1

    def __post_init__(self):
        for name in ("mlp_tiles", "layer_tiles"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"policy: {name} must be an int >= 1, got {n!r}")
        for cls in CLASSES:
            action = getattr(self, cls)
            if action not in ACTIONS:
                raise ValueError(f"policy: {cls} must be one of {', '.join(map(repr, ACTIONS))}, got {action!r}")
        rebuilt = self.rebuilt
        if rebuilt not in _REBUILDS:
            if "input" in rebuilt:
                raise ValueError("policy: input cannot be rebuilt (it is the layer's input; keep or offload it)")
            raise ValueError(f"policy: rebuilding {', '.join(sorted(rebuilt))} is not supported; a layer rebuilds "
                             "nothing (\"none\"), its norm and activation outputs (\"selective\"), everything but "
                             "its input (\"full\") or everything but its input and attention's output "
                             "(\"attention-kept\")")
        if self.mlp_tiles > 1 and self.mlp != "rebuild":
            raise ValueError(f"policy: mlp_tiles={self.mlp_tiles} runs the MLP again tile by tile in backward, which "
                             f"only a policy that rebuilds the MLP does (\"full\", \"attention-kept\"); "
                             f"{self.recompute!r} keeps it")
        if self.layer_tiles > 1 and self.recompute != "full":
            raise ValueError(f"policy: layer_tiles={self.layer_tiles} runs the whole layer again tile by tile in "
                             f"backward, which only \"full\" does; {self.recompute!r} keeps more than the input")
        if self.layer_tiles > 1 and self.mlp_tiles > 1:
            raise ValueError(f"policy: mlp_tiles={self.mlp_tiles} and layer_tiles={self.layer_tiles}: a layer tile "
                             "runs its MLP over the tile's tokens already; give one of them, not both")
        if self.recompute == "attention-kept" and self.attention == "offload":
            raise ValueError("policy: attention cannot be offloaded under \"attention-kept\" (its outputs are held "
                             "by the checkpoint's cache, outside the layer's pipeline); keep it, or offload the input")

    # cached: read at every training call of a layer, and a frozen policy's fields never change (the values live in
    # the instance dict, outside the fields that eq, hash and repr read)
    @functools.cached_property
    def rebuilt(self):
        """The classes rebuilt in backward."""
        return frozenset(c for c in CLASSES if getattr(self, c) == "rebuild")

    @functools.cached_property
    def offloaded(self):
        """The classes copied to host memory in forward and back before the layer's backward."""
        return frozenset(c for c in CLASSES if getattr(self, c) == "offload")

    @functools.cached_property
    def recompute(self):
        """The recompute mode that rebuilds what this policy rebuilds: "none", "selective" or "full"."""
        return _REBUILDS[self.rebuilt]

    def action(self, cls):
        """The action for a class; "keep" for "other"."""
        return "keep" if cls == OTHER else getattr(self, cls)

    def name(self):
        """The mode's name, with what is offloaded and the MLP's tiles: e.g. 'selective, offload mlp'."""
        out = self.recompute
        if self.offloaded:
            out += f", offload {'+'.join(c for c in CLASSES if c in self.offloaded)}"
        if self.mlp_tiles > 1:
            out += f", MLP in {self.mlp_tiles} tiles"
        if self.layer_tiles > 1:
            out += f", layer in {self.layer_tiles} tiles"
        return out

    def __str__(self):
        return self.name()

    def __eq__(self, other):
        # A policy that offloads nothing is one of the named modes and equals its name, so code written for modes
        # ("full", "selective", "none") reads policies too.
        if isinstance(other, str):
            return self.name() == other
        if isinstance(other, LayerPolicy):
            return self._key() == other._key()
        return NotImplemented

    def __hash__(self):
        return hash(self.name())

    def _key(self):
        return (*(getattr(self, c) for c in CLASSES), self.mlp_tiles, self.layer_tiles)


NAMED = {
    "none": LayerPolicy(norm_act="keep"),
    "selective": LayerPolicy(),
    "full": LayerPolicy(**{c: "rebuild" for c in CLASSES if c != "input"}),
    "attention-kept": LayerPolicy(**{c: "rebuild" for c in CLASSES if c not in ("input", "attention")}),
}
assert tuple(NAMED) == RECOMPUTE_MODES


def policy(base="selective", offload=(), mlp_tiles=1, layer_tiles=1):
    """A LayerPolicy: a mode's policy ("none", "selective", "full", "attention-kept") with the classes in
    `offload` offloaded and, where the MLP is rebuilt, the MLP run in `mlp_tiles` sequence tiles; under "full",
    the whole layer run in `layer_tiles` query tiles (keeping.layer_tiles).

    policy("selective", offload=["mlp"]) keeps everything selective keeps, the MLP's matmul outputs in host
    memory; policy("full", offload=["input"]) is whole-layer recompute with the layer inputs in host memory;
    policy("attention-kept", offload=["input"], mlp_tiles=8) keeps little and never runs attention's forward
    twice; policy("full", offload=["input"], layer_tiles=64) keeps the least of all: a layer's working set is
    its input, k and v and one tile's.
    """
    p = resolve(base)
    if isinstance(offload, str):
        offload = (offload,)
    if not isinstance(offload, (list, tuple, set, frozenset)):
        raise TypeError(f"offload must be a list of classes ({', '.join(CLASSES)}), got {type(offload).__name__}")
    changes = {}
    for cls in offload:
        if cls not in CLASSES:
            raise ValueError(f"offload: {cls!r} is not a class of tensor; the classes are {', '.join(CLASSES)}")
        if getattr(p, cls) == "rebuild":
            raise ValueError(f"offload: {cls} is rebuilt under {p.recompute!r}, so there is nothing of it to offload")
        changes[cls] = "offload"
    return dataclasses.replace(p, **changes, mlp_tiles=mlp_tiles, layer_tiles=layer_tiles)


def resolve(value, name="policy"):
    """A LayerPolicy from a mode name or a LayerPolicy, or the error naming `name`."""
    if isinstance(value, LayerPolicy):
        return value
    if isinstance(value, str):
        return NAMED[check_mode(value)]
    raise TypeError(f"{name} must be a recompute mode ({', '.join(map(repr, RECOMPUTE_MODES))}) or a "
                    f"selective_ckpt.keeping.LayerPolicy, got {type(value).__name__}")


def split_parts(parts, layer_policy, offloaded=True):
    """memory.estimate's parts (bytes) by class and residence: {class: {"device": bytes, "host": bytes}}.

    `offloaded=False` for a layer whose offload is never issued (the last layer: its backward runs first)."""
    p = resolve(layer_policy)
    out = {}
    for part, nbytes in parts.items():
        cls = PART_CLASSES.get(part, OTHER)
        where = "host" if offloaded and p.action(cls) == "offload" else "device"
        entry = out.setdefault(cls, {"device": 0, "host": 0})
        entry[where] += nbytes
    return out
