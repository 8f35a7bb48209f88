"""The parts of a decoder layer for memory.estimate: each says what it keeps for backward.

A layer is its residual stream (with its norms), its token mixer (attention, or a module kept as transformers'
own), its MLP (dense, or a mixture of experts) and what its forms add (products by a Python float). Every part has
one method, `keep(kept, sizes)`, which enters its tensors into `kept` ({name: bytes}) for the layer's sizes and
recompute mode (`Sizes`); memory.estimate sums what the parts enter, in the order the layer lists them. A new form
is a new part, handed to estimate (and LayerShape) in `parts`.
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


@dataclasses.dataclass(frozen=True)
class Residual:
    """The residual stream x, x1 and the norms on it: "pre-norm" keeps x and x1, "parallel" x alone (both branches
    read x), "post-norm" also the norms' inputs (o_proj's and down_proj's outputs), and in a residual stream of
    another dtype each projection's own cast of x (3) and x1 (2); `post_norms` (the "sandwich" form) keeps those
    norm inputs and their statistics besides the pre-norms'. "none" keeps the pre-norms' outputs too."""

    form: str = "pre-norm"
    norms: int = 2
    post_norms: bool = False

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

    qk_norm: object = None
    gate: bool = False
    weightless: bool = False  # rotated q/k norms without a weight (Llama 4): q, k rotated in their own dtype
    query_scales: bool = False  # q times a float32 scale per position (Llama 4's attention temperature)

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

    count: int

    def __post_init__(self):
        check_positive_int(self.count, "scalar_multipliers")

    def keep(self, kept, s):
        if s.rebuilds:
            kept["multipliers"] = 8 * self.count
