"""The parts of a decoder layer for memory.estimate: each says what it keeps for backward.

A layer is its residual stream (with its norms), its token mixer (attention, or a module kept as transformers'
own), its MLP (dense, or a mixture of experts) and what its forms add (products by a Python float). Every part has
one method, `keep(kept, sizes)`, which enters its tensors into `kept` ({name: bytes}) for the layer's sizes and
recompute mode (`Sizes`); memory.estimate sums what the parts enter, in the order the layer lists them. A part's
class names its `role` (ROLES: the order a layer lists them); a layer holds at most one part of each role. A layer
is its part list whole (`layer_of`, `check_layer`; `with_part` puts a part in its role's place), or the parts of
estimate's form keywords (`layer_parts`, the one place they become parts). A new form is a new part, handed to
estimate (and LayerShape) in `parts`.
"""

import dataclasses

import torch

from ..validation import check_positive_int


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What every part reads: t tokens, the widths, element sizes (e: the matmuls' dtype, er: the residual
    stream's, em: the MLP matmul outputs', acc: an fp32 statistic's, 8 for float64 layers) and the mode."""

    seq_len: int
    batch: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    e: int
    er: int
    em: int
    acc: int
    recompute: str
    dtype: torch.dtype
    residual_dtype: torch.dtype
    rms: bool = True
    norm_stats: bool = True  # the norms keep their statistics (False: they run their own forward again)

    @property
    def t(self):
        return self.seq_len * self.batch

    @property
    def qw(self):
        """The query width: attention's output and o_proj's input (hidden unless head_dim is given)."""
        return self.heads * self.head_dim

    @property
    def rebuilds(self):
        """Whether the layer keeps more than its checkpoint ("selective" and "none")."""
        return self.recompute in ("selective", "none")


RESIDUALS = ("pre-norm", "parallel", "post-norm")


def check_residual(residual, norms):
    """A layer's residual form and norm count (estimate's keywords, Residual's fields), or the error naming them."""
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {', '.join(map(repr, RESIDUALS))}, got {residual!r}")
    if isinstance(norms, bool) or norms not in (1, 2):
        raise ValueError(f"norms must be 1 or 2, got {norms!r}")
    if residual == "pre-norm" and norms != 2:
        raise ValueError(f"norms must be 2 for a pre-norm layer (its second norm reads x1), got {norms!r}")


@dataclasses.dataclass(frozen=True)
class Residual:
    """The residual stream x, x1 and the norms on it: "pre-norm" keeps x and x1, "parallel" x alone (both branches
    read x), "post-norm" also the norms' inputs (o_proj's and down_proj's outputs), and in a residual stream of
    another dtype each projection's own cast of x (3) and x1 (2); `post_norms` (the "sandwich" form) keeps those
    norm inputs and their statistics besides the pre-norms'. "none" keeps the pre-norms' outputs too."""

    role = "residual"
    form: str = "pre-norm"
    norms: int = 2
    post_norms: bool = False

    def __post_init__(self):
        check_residual(self.form, self.norms)

    def keep(self, kept, s):
        t, h = s.t, s.hidden
        kept["x"] = t * h * s.er
        if not s.rebuilds:
            return
        if self.form != "parallel":
            kept["x1"] = t * h * s.er
        if s.norm_stats:
            kept["norm_stats" if s.rms else "ln_stats"] = (1 if s.rms else 2) * self.norms * t * s.acc
        if self.form == "post-norm":
            kept.update(attn_out=t * h * s.e, mlp_out=t * h * s.em)
            # x and x1 feed Linears directly (no norm output to rebuild casts from): in a residual stream of
            # another dtype (fp32 under autocast) each projection keeps its own cast instead (q, k, v; gate, up)
            if s.er != s.e:
                kept["x"] = 3 * t * h * s.e
            if s.er != s.em:
                kept["x1"] = 2 * t * h * s.em
        elif s.recompute == "none":
            kept.update(ln1_out=t * h * s.e, ln2_out=t * h * s.e)
            if self.norms == 1:
                del kept["ln2_out"]
        if self.post_norms:
            kept.update(attn_out=t * h * s.e, mlp_out=t * h * s.em)
            if s.norm_stats:
                kept["post_norm_stats"] = 2 * t * s.acc


@dataclasses.dataclass(frozen=True)
class Attention:
    """Attention and its projections: q/k/v, o and the logsumexp ("attention-kept" caches o and the logsumexp).

    `qk_norm`: True (per head before RoPE: each norm keeps its input and a statistic per head; the rotated q, k
    are rebuilt from them under "selective", so q/k/v keeps v alone), "projection" (over the whole q_proj / k_proj
    output: a statistic per token), "rotated" (per head after RoPE: the norms' inputs are the rotated q, k, in the
    residual stream's dtype under autocast, their outputs rebuilt). `gate` (Qwen3-Next): o_proj reads o times
    sigmoid of a second half of q_proj, which the q norm's input then holds too; the product is rebuilt.
    `weightless` rotated norms keep a row of ones each instead of a weight; `query_scales` keep one fp32 scale per
    position."""

    role = "attention"
    qk_norm: object = None
    gate: bool = False
    weightless: bool = False  # rotated q/k norms without a weight (Llama 4): q, k rotated in their own dtype
    query_scales: bool = False  # q times a float32 scale per position (Llama 4's attention temperature)

    def __post_init__(self):
        if self.qk_norm not in (None, True, "projection", "rotated"):
            raise ValueError(f"qk_norm must be None, True (per head), 'projection' (q/k norms over the whole "
                             f"projection) or 'rotated' (per head after RoPE), got {self.qk_norm!r}")

    def keep(self, kept, s):
        if s.recompute == "full":
            return
        t, heads, kv, d = s.t, s.heads, s.kv_heads, s.head_dim
        kept.update(o=t * s.qw * s.e, lse=heads * t * s.acc)
        if not s.rebuilds:
            return
        kept["qkv"] = t * (s.qw + 2 * kv * d) * s.e
        if self.qk_norm in (True, "projection"):
            kept["qk_norm_in"] = t * (heads + kv) * d * s.e
            if s.norm_stats:
                kept["qk_norm_stats"] = (2 if self.qk_norm == "projection" else heads + kv) * t * s.acc
            if self.qk_norm is True and s.er != s.e:  # weights of the residual stream's dtype on q, k of `dtype`:
                kept["qk_norm_ones"] = 2 * d * s.e    # each norm keeps a row of ones
            if s.recompute == "selective" and not self.gate:
                kept["qkv"] = t * kv * d * s.e  # the rotated q, k are rebuilt from the norms' inputs: v alone
        if self.gate:
            if self.qk_norm is True:
                kept["qk_norm_in"] += t * heads * d * s.e
            if s.recompute == "none":
                kept["attn_gate_product"] = t * heads * d * s.e
        if self.qk_norm == "rotated":
            # RoPE multiplies q, k by tables of the residual stream's dtype: under autocast the rotated q, k (the
            # norms' inputs, and "none"'s outputs) are fp32, v stays in `dtype`
            eq = s.e if self.weightless else max(s.e, s.er)
            kept["qkv"] = t * ((heads + kv) * d * eq + kv * d * s.e)
            kept["qk_norm_stats"] = t * (heads + kv) * s.acc
            if s.recompute == "none":
                kept["qk_norm_out"] = t * (heads + kv) * d * eq
            if self.weightless:
                kept["qk_norm_ones"] = 2 * d * s.e
        if self.query_scales:
            kept["query_scales"] = s.seq_len * 4


@dataclasses.dataclass(frozen=True)
class DenseMLP:
    """One MLP: gated (gate and up outputs kept, act(gate) * up rebuilt) or plain (fc1's output kept, the
    activation's rebuilt); "none" keeps the product or the activation's output too."""

    role = "mlp"
    gated: bool

    def keep(self, kept, s):
        if not s.rebuilds:
            return
        t, f = s.t, s.ffn
        if self.gated:
            kept.update(gate_out=t * f * s.em, up_out=t * f * s.em)
        else:
            kept["fc1_out"] = t * f * s.em
        if s.recompute == "none":
            kept["product" if self.gated else "gelu_out"] = t * f * s.e


@dataclasses.dataclass(frozen=True)
class Scalars:
    """Products by a Python float, each keeping the float as a 0-dim float64 tensor (8 bytes)."""

    role = "scalars"
    count: int

    def __post_init__(self):
        check_positive_int(self.count, "scalar_multipliers")

    def keep(self, kept, s):
        if s.rebuilds:
            kept["multipliers"] = 8 * self.count


# --- A layer: its parts in order, one per role.

# The roles of a layer's parts, in the order they enter what it keeps; parts of no role (new forms) come last.
ROLES = ("residual", "attention", "mixer", "mlp", "scalars")


def role_of(part):
    """The role a part plays in its layer (ROLES), None for a part of no role."""
    return getattr(type(part), "role", None)


def with_part(parts, part):
    """A layer's part list `parts` with `part` in place of the part of its role (the attention: Attention or
    memory.MLA; the MLP: DenseMLP or memory.MoE), or entered in its role's order where the layer has none; a part of
    no role comes last. Scalars add to the layer's: each counts products by a float."""
    role = role_of(part)
    if role is None:
        return (*parts, part)
    old = next((p for p in parts if role_of(p) == role), None)
    if isinstance(part, Scalars) and old is not None:
        part = Scalars(old.count + part.count)
    rest = [p for p in parts if p is not old]
    rank = ROLES.index(role)
    at = next((i for i, p in enumerate(rest) if role_of(p) is None or ROLES.index(role_of(p)) > rank), len(rest))
    return (*rest[:at], part, *rest[at:])


FORMS = dict(residual="pre-norm", norms=2, qk_norm=None, scalar_multipliers=0, post_norms=False, moe=None, mixer=None,
             attn_gate=False)  # estimate's form keywords and their defaults (a layer of none of these forms)


def layer_of(parts=(), gated=False, **forms):
    """A layer's complete part list: `parts` as they are where they hold a Residual (the whole layer; `forms` then
    left at their defaults), checked, else the parts of `forms` (estimate's keywords, FORMS) then `parts`."""
    if not any(isinstance(p, Residual) for p in parts):
        return layer_parts(gated=gated, parts=parts, **forms)
    given = [f"{k}={v!r}" for k, v in forms.items() if (v != FORMS[k] if k in ("residual", "norms") else v)]
    if given:
        raise ValueError(f"parts holds a Residual, so it is the whole layer; {', '.join(given)} would describe it "
                         "again: give the layer as parts or as keywords, not both")
    return check_layer(parts, gated)


def check_layer(parts, gated):
    """`parts`, a whole layer (memory/parts.py): each has keep(kept, sizes), one part per role (one Residual, one
    attention, ...), a DenseMLP as gated as the activation, and a mixer only in forms that are modelled."""
    _check_keep(parts)
    roles = [role_of(p) for p in parts if role_of(p) is not None]
    twice = sorted({r for r in roles if roles.count(r) > 1})
    if twice:
        raise ValueError(f"parts: more than one part of role {', '.join(twice)} "
                         f"({', '.join(type(p).__name__ for p in parts if role_of(p) in twice)}); a layer holds one")
    dense = next((p for p in parts if isinstance(p, DenseMLP)), None)
    if dense is not None and dense.gated != gated:
        raise ValueError(f"parts: DenseMLP(gated={dense.gated}) with a {'gated' if gated else 'plain'} activation "
                         "(the `activation` keyword decides)")
    mixer = next((p for p in parts if role_of(p) == "mixer"), None)
    attention = next((p for p in parts if role_of(p) == "attention"), None)
    name = getattr(mixer, "name", type(mixer).__name__)
    if mixer is not None and (attention is None) == getattr(mixer, "attention", False):
        raise ValueError(f"parts: mixer {name!r} with{'out' if attention is None else ''} an attention part: a mixer "
                         "beside attention (attention=True) needs one, a mixer in attention's place has none")
    if mixer is not None and attention is not None and not (
            type(attention) is Attention and attention.qk_norm is not True and not attention.gate):
        raise ValueError(f"parts: {type(attention).__name__} beside mixer {name!r}: per-head q/k norms, "
                         "an output gate or latent attention beside a mixer are not modelled")
    return tuple(parts)


def _check_keep(parts):
    for part in parts:
        if not callable(getattr(part, "keep", None)):
            raise TypeError(f"parts: {type(part).__name__} has no keep(kept, sizes) method")


def layer_parts(residual="pre-norm", norms=2, qk_norm=None, post_norms=False, moe=None, mixer=None, attn_gate=False,
                scalar_multipliers=0, gated=False, parts=()):
    """The parts of a layer of these forms (estimate's keywords of the same names), in the order they enter what
    the layer keeps: its residual stream and norms, its attention (unless a mixer holds its place), its kept mixer,
    its MLP (dense or `moe`), its float scalars, then `parts`. The one place the keywords become parts."""
    _check_keep(parts)
    if mixer is not None and (qk_norm or attn_gate) and (not mixer.attention or qk_norm is True or attn_gate):
        raise ValueError(f"qk_norm={qk_norm!r}, attn_gate={attn_gate!r} with mixer {mixer.name!r}: a layer whose mixer "
                         "holds attention's place has no q/k norms or output gate, and per-head q/k norms or a gate on "
                         "attention beside a mixer are not modelled")
    out = [Residual(residual, norms, bool(post_norms))]
    if mixer is None or mixer.attention:
        out.append(Attention(qk_norm or None, bool(attn_gate)))
    if mixer is not None:
        out.append(mixer)
    out.append(moe if moe is not None else DenseMLP(gated))
    if scalar_multipliers:
        out.append(Scalars(scalar_multipliers))
    return out + list(parts)
