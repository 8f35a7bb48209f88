"""What a SelectiveDecoderLayer keeps for backward from its shape alone (docs/DESIGN.md, the floor),
and the FLOPs each recompute mode spends again in backward.
"""

import dataclasses

import torch

from .. import rng
from ..keeping.policy import resolve, split_parts
from ..validation import GATED_ACTIVATIONS, check_layer_shape, check_positive_int
from .parts import Sizes, check_residual, layer_of
from .units import as_dtype


def check_shape(hidden_dim, num_heads, mlp_ratio, **layer_kwargs):
    """The layer's own constructor checks, so estimates exist exactly for layers that can be built.

    layer_kwargs: the layer's keyword-only shape arguments (num_kv_heads, ffn_dim, norm, activation,
    rope_theta, sliding_window, head_dim). Returns the MLP width.
    """
    return check_layer_shape(hidden_dim, num_heads, mlp_ratio, **layer_kwargs)[2]


def estimate(hidden_dim, num_heads, seq_len, batch, dtype, mlp_ratio=4, recompute="selective", breakdown=False,
             dropout=0.0, attn_dropout=0.0, residual_dtype=None, mlp_dtype=None, lora=None, residual="pre-norm",
             norms=2, qk_norm=None, norm_stats=True, scalar_multipliers=0, post_norms=False, moe=None, mixer=None,
             attn_gate=False, parts=(), **layer_kwargs):
    """Bytes one SelectiveDecoderLayer keeps for backward (docs/DESIGN.md's memory contract).

    layer_kwargs are the layer's keyword-only shape arguments: num_kv_heads, ffn_dim, norm,
    activation, rope_theta, sliding_window (these two change no byte), head_dim. A Llama-style layer
    (norm="rmsnorm", gated activation) keeps, with D the head dim and Hkv the kv heads:
      selective: t*(h + (h + 2*Hkv*D) + h + h + 2f)*e  [x, q/k/v, o, x1, gate and up outputs]
                 + a*t*4 [lse] + 2*t*4 [one rstd per RMSNorm]
      none:      adds both norm outputs and the product act(gate) * up: t*(2h + f)*e

    With e = element size, t = s*b tokens, h hidden, a heads, f = the layer's fc1 width and 4-byte
    fp32 statistics (8 for float64 layers):
      selective: t*(h + 3h + h + h + f)*e  [x, q/k/v, o, x1, fc1 out] + a*t*4 [lse] + 2*2*t*4 [LN mean, rstd]
      none:      t*(h + h + 3h + h + h + h + 2f)*e  [adds LN1, LN2 and GELU outputs] + the same lse and stats
      full:      t*h*e  [the layer input only]
      attention-kept: t*h*e + t*h*e + a*t*4  [the layer input, attention's output and logsumexp]
    With an explicit `head_dim` D whose query width a*D is not h (gpt-oss, Gemma), q and attention's output
    (o_proj's input) are a*D wide instead of h: q/k/v t*(a*D + 2*Hkv*D)*e, o t*a*D*e; x, x1, the norms' and
    o_proj's outputs stay h wide.
    Dropout keeps an 8-byte seed tensor per site that is on (rates `dropout`, `attn_dropout` as in
    the layer, training): attention probabilities, proj output, MLP output; "full" keeps none.
    `breakdown=True` returns a dict of the parts (bytes) instead of the total.

    `recompute` is a mode or a keeping.LayerPolicy: its mode decides what is kept; what it offloads is kept in
    host memory instead. `breakdown="class"` returns {class: {"device": bytes, "host": bytes}}
    (keeping.split_parts) for a layer whose offload is issued, "class-last" for the model's last layer, whose
    offload never is (its backward runs first).

    Training configurations (docs/DESIGN.md, "The floor under training configurations"): `dtype` is
    the dtype attention and the matmuls run in (autocast's under autocast), `residual_dtype` that of
    the residual stream x, x1 (fp32 weights under autocast, fp32 after prepare_model_for_kbit_training;
    default `dtype`), `mlp_dtype` that of the gate/up (fc1) outputs (a 4-bit Linear casts back to its
    input's dtype; default `dtype`). `lora` (memory.LoRA) adds its rank terms: each adapted projection
    keeps lora_A's output (rank elements per token in lora.dtype) and, with dropout, an 8-byte seed;
    everything else LoRA reads (its dropped and cast inputs) is rebuilt.

    Residual forms: `residual="pre-norm"` (x1 = x + attention branch feeds the second norm) or
    "parallel" (attention and MLP both read the layer input x, as Cohere's and GPT-NeoX's
    use_parallel_residual layers do: no x1 is kept). `norms` is the number of norms the layer runs
    (statistics and, under "none", outputs per norm): 2, or 1 for one norm shared by both branches.

    Converted Hugging Face layers of other forms (models/hf.py): `residual="post-norm"` (OLMo2: x +
    norm(attn(x)), x1 + norm(mlp(x1))) keeps the two norms' inputs, the o_proj output (t*h*e) and the
    down_proj output (t*h*e_mlp), besides x and x1 that the projections read (as their own casts, 3 of x
    and 2 of x1, when the residual stream has another dtype: fp32 weights under autocast); no norm output is
    consumed by a saving op, so "none" adds only the product. `qk_norm="projection"` (q/k RMSNorm over the
    whole q_proj / k_proj output) keeps those outputs, t*(H*D + Hkv*D)*e; q and k after RoPE are rebuilt from
    them under "selective" (kept under "none").
    `norm_stats=False`: the norms keep no rstd (norms that run their own forward again in backward), the q/k norms
    and post-norms included.
    `scalar_multipliers`: products by a Python float keeping it as a 0-dim float64 tensor, 8 bytes each.

    `qk_norm=True` (Qwen3, Gemma3: an RMSNorm per head on q and k before RoPE): each norm keeps its
    input, the q/k projection outputs t*(H + Hkv)*D*e, and an fp32 rstd per head and token, t*(H + Hkv)*4;
    the rotated q, k attention reads are rebuilt from them under "selective" (so q/k/v counts v alone: Llama's
    bytes plus the statistics) and kept under "none" (and with `attn_gate`, whose forward is the hybrids' own);
    with weights in `residual_dtype` on q, k of `dtype` (autocast) each norm keeps a row of D ones in `dtype`.
    `post_norms=True` (Gemma2, Gemma3: an RMSNorm on the attention and on the MLP output before each residual
    add, four norms a layer): each keeps its input, a matmul output (o_proj's t*h*e, down_proj's t*h*e_mlp),
    and its rstd, t*4 each. Their outputs feed RoPE or a residual add, which keep none of them, so "none" adds
    nothing for them.
    `qk_norm="rotated"` (HunYuan: an RMSNorm per head on q and k after RoPE): the norms' inputs are the rotated
    q, k, and attention reads their outputs, rebuilt, so the layer adds only the fp32 rstd per head and token,
    t*(H + Hkv)*4; "none" keeps the outputs too, t*(H + Hkv)*D*e. RoPE's tables have the residual stream's
    dtype, so under autocast the rotated q, k (and those outputs) count in `residual_dtype`.

    `moe` (memory.MoE): the layer's MLP is a sparse mixture of experts instead of one gated MLP; its
    parts (routed rows, router, shared expert; see MoE) replace gate_out and up_out.

    `attn_gate=True` (Qwen3-Next, Qwen3.5: q_proj emits q and a gate per head, o_proj reads o * sigmoid(gate)):
    with qk_norm=True the q norm's input is a view of the whole q_proj output, q and gate, so qk_norm_in counts
    H*D more; the gated product is rebuilt from o and the gate (kept under "none": H*D).
    `mixer` (memory.Mixer): the layer holds a token mixer kept as transformers' own (a Gated DeltaNet) instead
    of attention: no q/k/v, o or lse; the mixer's own saved bytes instead (its input, the first norm's output,
    is rebuilt under "selective" and kept under "none" as ln1_out). "full" and "attention-kept" keep x only.
    A mixer with `attention=True` runs beside the attention on the same normed input (Falcon-H1): attention's
    parts stay, plus the normed input times a number that q/k/v read (t*h*e; one cast each under autocast).

    A layer is its parts (memory/parts.py), each entering what it keeps: the keywords above are the shorthand of a
    layer described by hand, translated into parts by `parts.layer_parts`. `parts` holding a Residual is the whole layer
    as it is (a LayerShape's parts, as convert reads them; the form keywords are then left out): the residual
    stream, the attention (parts.Attention, or memory.MLA: DeepSeek-V3's latent attention, docs/kernels/mla.md) or
    none where a mixer holds its place, memory.Mixer, the MLP (parts.DenseMLP, or memory.MoE), parts.Scalars, then
    parts of other forms, e.g. [Residual(), Attention(qk_norm="rotated", weightless=True, query_scales=True),
    DenseMLP(gated=True)] for a Llama 4 layer (q/k norms without a weight after RoPE, q scaled per position).
    Without a Residual, `parts` adds other forms' parts after those of the keywords. Either way a part is any
    object with `keep(kept, sizes)`.
    """
    forms = dict(residual=residual, norms=norms, qk_norm=qk_norm, scalar_multipliers=scalar_multipliers,
                 post_norms=post_norms, moe=moe, mixer=mixer, attn_gate=attn_gate)
    check_residual(residual, norms)
    head_dim, kv_heads, ffn = check_layer_shape(hidden_dim, num_heads, mlp_ratio, **layer_kwargs)
    gated = layer_kwargs.get("activation", "gelu") in GATED_ACTIVATIONS
    rms = layer_kwargs.get("norm", "layernorm") == "rmsnorm"
    check_positive_int(seq_len, "seq_len")
    check_positive_int(batch, "batch")
    layer_policy = resolve(recompute, "recompute")
    recompute = layer_policy.recompute
    if breakdown not in (False, True, "class", "class-last"):
        raise ValueError(f"breakdown must be False, True, 'class' or 'class-last', got {breakdown!r}")
    if not isinstance(norm_stats, bool):
        raise TypeError(f"norm_stats must be a bool, got {type(norm_stats).__name__}")
    if scalar_multipliers != 0:
        check_positive_int(scalar_multipliers, "scalar_multipliers")
    layer = layer_of(parts, gated, **forms)
    dtype = as_dtype(dtype)
    e = _size(dtype)
    er = _size(as_dtype(residual_dtype, "residual_dtype")) if residual_dtype is not None else e
    em = _size(as_dtype(mlp_dtype, "mlp_dtype")) if mlp_dtype is not None else e
    acc = 8 if dtype == torch.float64 else 4
    t = seq_len * batch
    h = hidden_dim
    sizes = Sizes(seq_len, batch, h, num_heads, kv_heads, head_dim, ffn, e, er, em, acc, recompute, dtype,
                  as_dtype(residual_dtype) if residual_dtype is not None else dtype, rms, norm_stats)
    kept = {}
    for part in layer:
        part.keep(kept, sizes)
    if sizes.rebuilds:
        rng.threshold(dropout, "dropout")
        rng.threshold(attn_dropout, "attn_dropout")
        sites = (attn_dropout > 0) + 2 * (dropout > 0)
        if sites:
            kept["seeds"] = 8 * sites
        if lora is not None:
            kept.update(lora.kept(t))
    if breakdown in ("class", "class-last"):
        return split_parts(kept, layer_policy, offloaded=breakdown == "class")
    return kept if breakdown else sum(kept.values())


def _size(dtype):
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class LoRA:
    """PEFT LoRA on a converted layer, for `estimate`: the adapted projections and their ranks.

    `ranks`: projection name -> rank (e.g. {"q_proj": 16, ...}); `dtype`: the dtype lora_A's output is
    computed in (autocast's under autocast, else the adapter weights'); `dropout`: lora_dropout; `scaling_kept`: PEFT's
    forward runs (its `* scaling` operand is kept), False where the fused layout computes the adapters.
    """

    ranks: dict
    dtype: torch.dtype = torch.float32
    dropout: float = 0.0
    scaling_kept: bool = True

    def __post_init__(self):
        if not isinstance(self.ranks, dict) or not self.ranks:
            raise TypeError(f"ranks must be a non-empty dict of projection name -> rank, got {self.ranks!r}")
        for name, r in self.ranks.items():
            check_positive_int(r, f"ranks[{name!r}]")
        as_dtype(self.dtype, "dtype")
        rng.threshold(self.dropout, "dropout")

    def kept(self, tokens):
        # PEFT's `lora_B(...) * scaling` keeps the Python float as a 0-dim float64 tensor (8 bytes)
        parts = {"lora_a_out": tokens * sum(self.ranks.values()) * _size(as_dtype(self.dtype))}
        if self.scaling_kept:
            parts["lora_scaling"] = 8 * len(self.ranks)
        if self.dropout > 0:
            parts["lora_seeds"] = 8 * len(self.ranks)
        return parts


@dataclasses.dataclass(frozen=True)
class MoE:
    """A sparse mixture-of-experts MLP (a model spec's `ModelSpec.moe` as converted), for `estimate`.

    `num_experts` experts of width `expert_dim`, `top_k` of them per token: t*top_k routed rows, each
    keeping its expert's gate and up outputs (2*expert_dim elements of the MLP's dtype); act(gate) * up,
    the expert's down output and the routed-weighted product are rebuilt in backward. The router, as
    transformers computes it, keeps the fp32 softmax over the experts (t*num_experts*4 bytes), top-k's
    indices (t*top_k int64) and the routing weights (t*top_k elements of `weights_dtype`, None: the
    layer's dtype); with `norm_topk_prob` also their fp32 sum per token and a copy of the fp32 top-k
    values (transformers divides them in place, and autograd keeps the original for the divisor's gradient).
    `shared_dim` > 0: a shared expert of that width keeps its gate and up
    outputs and its sigmoid gate's output (one element per token, in the layer's dtype). In "none" mode
    the shared expert's product is kept as well (the routed products are rebuilt in every mode).
    """

    role = "mlp"  # memory.parts' role: in place of DenseMLP
    num_experts: int
    top_k: int
    expert_dim: int
    weights_dtype: torch.dtype = None
    norm_topk_prob: bool = True
    shared_dim: int = 0
    shared_gate: bool = True  # the shared expert is scaled by a sigmoid gate (Qwen2-MoE); False: added as is (GLM-4.5)
    # "softmax_topk": the softmax over all experts, then top-k of it (keeps the fp32 softmax); "topk_softmax"
    # (gpt-oss): top-k of the logits, then a softmax over those k, whose output (the routing weights) is all it keeps
    router: str = "softmax_topk"

    def __post_init__(self):
        check_positive_int(self.num_experts, "num_experts")
        check_positive_int(self.top_k, "top_k")
        check_positive_int(self.expert_dim, "expert_dim")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        if self.weights_dtype is not None:
            as_dtype(self.weights_dtype, "weights_dtype")
        if self.router not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"router must be 'softmax_topk' or 'topk_softmax', got {self.router!r}")
        if not isinstance(self.shared_dim, int) or self.shared_dim < 0:
            raise ValueError(f"shared_dim must be an int >= 0, got {self.shared_dim!r}")

    def keep(self, kept, sizes):
        """memory.parts' protocol: the routed rows, router and shared expert, in the modes that keep them."""
        if sizes.rebuilds:
            kept.update(self.kept(sizes.t, sizes.em, sizes.e, sizes.recompute))

    def kept(self, tokens, mlp_size, size, recompute="selective"):
        """Parts (bytes) for `tokens` tokens; mlp_size / size: element sizes of the MLP's matmul outputs and
        of the layer's dtype."""
        t, k = tokens, self.top_k
        ew = size if self.weights_dtype is None else _size(as_dtype(self.weights_dtype))
        parts = {"expert_gate_up": t * k * 2 * self.expert_dim * mlp_size, "router_probs": t * self.num_experts * 4,
                 "router_indices": t * k * 8, "routing_weights": t * k * ew}
        if self.router == "topk_softmax":
            del parts["router_probs"]
        if self.norm_topk_prob:  # the in-place division keeps its divisor and a copy of the top-k values
            parts.update(router_topk_sum=t * 4, router_topk_copy=t * k * 4)
        if self.shared_dim:
            parts.update(shared_gate_out=t * self.shared_dim * mlp_size, shared_up_out=t * self.shared_dim * mlp_size)
            if self.shared_gate:
                parts["shared_sigmoid"] = t * size
            if recompute == "none":
                parts["shared_product"] = t * self.shared_dim * size
                if self.shared_gate:
                    parts["shared_scaled"] = t * self.shared_dim * size
        return parts


# Set by convert on each token mixer kept as transformers' own module (its value: why): the ledger counts what is
# saved inside such a module apart (SavedEntry.mixer, LedgerReport.mixer_bytes). A plain attribute, not state.
KEPT_MIXER = "_selective_ckpt_kept_mixer"


@dataclasses.dataclass(frozen=True)
class Mixer:
    """A token mixer kept as transformers' implementation (a hybrid model's Gated DeltaNet), for `estimate`:
    `saved(seq_len, batch, input_dtype, compute_dtype)` gives the bytes its own forward keeps for backward
    (models/hybrid.py measures them by running that forward on fake tensors)."""

    role = "mixer"  # memory.parts' role
    name: str
    saved: object
    attention: bool = False  # the layer runs attention beside it (Falcon-H1), not instead of it

    def __post_init__(self):
        if not callable(self.saved):
            raise TypeError(f"Mixer.saved must be callable (seq_len, batch, input_dtype, compute_dtype) -> bytes, "
                            f"got {type(self.saved).__name__}")

    def kept(self, seq_len, batch, input_dtype, compute_dtype):
        return int(self.saved(seq_len, batch, input_dtype, compute_dtype))

    def keep(self, kept, s):
        """memory.parts' protocol: what the mixer saves and, beside attention, the scaled input q/k/v read."""
        if not s.rebuilds:
            return
        if self.attention:  # q/k/v read the normed input times a number: that product (autocast: each one's cast)
            kept["attn_in"] = (3 if s.er != s.e else 1) * s.t * s.hidden * s.e
        kept["mixer"] = self.kept(s.seq_len, s.batch, s.residual_dtype, s.dtype)


# Elementwise FLOPs per element (coarse, but only their ratio to the matmuls matters for a plan).
LN_FWD_FLOPS = 8  # mean, variance, normalise, affine
LN_OUT_FLOPS = 4  # (x - mean) * rstd * w + b from the saved statistics
GELU_FLOPS = 8
SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide


def forward_flops(hidden_dim, num_heads, seq_len, batch, mlp_ratio=4, causal=True, attention=True, **layer_kwargs):
    """FLOPs of one layer forward: the matmuls (qkv, proj, the MLP's two or three), attention (QK^T and
    PV, halved when causal, limited to the window if any), norms, softmax, activation and the two
    residual adds. `attention=False` leaves attention's own FLOPs out (what the attention-kept re-run does)."""
    head_dim, kv_heads, ffn = check_layer_shape(hidden_dim, num_heads, mlp_ratio, **layer_kwargs)
    mlp_mats = 3 if layer_kwargs.get("activation", "gelu") in GATED_ACTIVATIONS else 2
    t, h, s = seq_len * batch, hidden_dim, seq_len
    c = 0.5 if causal else 1.0
    window = layer_kwargs.get("sliding_window")
    if window is not None and window < s:
        c = window / s  # each query attends at most `window` keys
    qw = num_heads * head_dim
    matmul = 2 * t * h * ((qw + 2 * kv_heads * head_dim) + qw + mlp_mats * ffn)
    attn = 2 * 2 * t * s * qw * c + SOFTMAX_FLOPS * num_heads * t * s * c if attention else 0
    return int(matmul + attn + 2 * LN_FWD_FLOPS * t * h + GELU_FLOPS * t * ffn + 2 * t * h)


def recompute_flops(hidden_dim, num_heads, seq_len, batch, mlp_ratio=4, recompute="selective", causal=True,
                    **layer_kwargs):
    """Extra FLOPs a mode spends in backward, over "none".

    none = 0. selective = re-deriving the two LayerNorm outputs from the saved input and statistics
    and the GELU output from the fc1 output (attention's softmax is rebuilt from logsumexp in every
    mode, since the fused attention never stores it, so it is no extra cost of "selective"). full =
    one more forward of the layer (`forward_flops`); attention-kept = that forward without attention's.
    A gated MLP's product act(gate) * up is rebuilt instead of the GELU output, at the same coarse cost
    per element. `recompute` may be a keeping.LayerPolicy (its mode counts).
    """
    ffn = check_shape(hidden_dim, num_heads, mlp_ratio, **layer_kwargs)
    recompute = resolve(recompute, "recompute").recompute
    t = seq_len * batch
    if recompute == "none":
        return 0
    if recompute == "selective":
        return 2 * LN_OUT_FLOPS * t * hidden_dim + GELU_FLOPS * t * ffn
    return forward_flops(hidden_dim, num_heads, seq_len, batch, mlp_ratio, causal,
                         attention=recompute == "full", **layer_kwargs)


def loss_head_estimate(tokens, vocab, hidden_dim, dtype, reduction="mean", weight_grad=True, bias=False,
                       chunk_bytes=None, breakdown=False):
    """Bytes the fused loss head (ops/cross_entropy.py, linear_cross_entropy) keeps after forward, and
    the transient of one chunk, for `tokens` rows of `hidden_dim` against a `vocab` x `hidden_dim` weight.

    mean / sum (gradients formed in forward): kept = dhidden t*h*e + dweight V*h*e (weight_grad) +
    dbias V*e (bias); reduction="none": kept = the loss per row, t*4 (8 for float64), since it keeps
    only its inputs, which exist anyway. chunk = one chunk's logits, chunk_rows(...) * V * e. The
    step's transient peak above what is kept is at most one chunk, its per-row statistics and, for
    16-bit weights over more than one chunk, the float32 weight-gradient accumulator and one chunk's
    product (4 + 2) * V*h. `breakdown=True` returns the dict of parts (bytes).
    """
    from ..ops.cross_entropy import REDUCTIONS, chunk_rows

    for value, name in ((tokens, "tokens"), (vocab, "vocab"), (hidden_dim, "hidden_dim")):
        check_positive_int(value, name)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    dtype = as_dtype(dtype)
    e = torch.empty((), dtype=dtype).element_size()
    acc = 8 if dtype == torch.float64 else 4
    t, v, h = tokens, vocab, hidden_dim
    rows = chunk_rows(t, v, h, e, chunk_bytes)
    if reduction == "none":
        parts = {"loss_rows": t * acc}
    else:
        parts = {"dhidden": t * h * e}
        if weight_grad:
            parts["dweight"] = v * h * e
        if bias:
            parts["dbias"] = v * e
    parts["chunk"] = rows * v * e
    parts["accumulator"] = (4 + e) * v * h if weight_grad and e < 4 and rows < t else 0
    if breakdown:
        return parts
    return sum(v for k, v in parts.items() if k not in ("chunk", "accumulator"))
