"""The pre-norm SelectiveDecoderLayer and set_recompute, with recompute modes.

Any norm (LayerNorm, RMSNorm) goes with any MLP (plain fc1 -> act -> fc2 for activation "gelu" /
"gelu_tanh", gated down(act(gate) * up) for "swiglu" / "geglu"). Per token, in elements, a layer
keeps for backward (docs/DESIGN.md, "What a layer keeps" and "The decoder layer"):

- "selective": x (norm 1 input) h, the qkv output (H + 2 Hkv) D (q, k, v are views of it, after
  RoPE), the attention output o h (proj reads it in place), x1 (norm 2 input) h and the MLP's
  matmul outputs (fc1: ffn; gate and up: 2 ffn): 10 h for a GPT-style layer with mlp_ratio 4, plus
  the fp32 row logsumexp [B, H, S] and each norm's fp32 statistics (LayerNorm: mean and rstd,
  RMSNorm: rstd) [B, S].
- "none": the same kernels, but both norm outputs and the activation output (or product) are kept too.
- "full": torch.utils.checkpoint (non-reentrant) around the whole layer: only its input.

All three give bit-identical outputs and gradients: the dropout seeds are drawn before the
checkpointed region, so the re-run regenerates the same masks, and stored and recomputed norm and
activation outputs come from the same kernels.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import norm_fusion, rng, rotary
from .activations import ACTIVATIONS, GATED_LAYER_ACTIVATIONS
from .keeping import pipeline, tiling
from .keeping.attention_kept import attention_kept_checkpoint
from .keeping.policy import CHECKPOINTED, LayerPolicy, resolve
from .ops.attention import attention_fwd_op
from .ops.dropout import dropout_op
from .registry import recomputable, recomputable_layers, state_of
from .validation import (
    RECOMPUTE_MODES,
    SUPPORTED_DTYPES,
    check_bool,
    check_layer_shape,
    check_positive_float,
    check_positive_int,
)


def _check_input(x, hidden_dim, attention_mask, module):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor [B, S, {hidden_dim}], got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != hidden_dim:
        raise ValueError(f"x must have shape [B, S, {hidden_dim}], got {list(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    _check_matches_parameters(x, module)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            raise TypeError("attention_mask must be a bool tensor [B, S] (True = attend) or None")
        if attention_mask.shape != x.shape[:2]:
            raise ValueError(f"attention_mask must have shape {list(x.shape[:2])} ([B, S]), "
                             f"got {list(attention_mask.shape)}")
        if attention_mask.device != x.device:
            raise ValueError(f"attention_mask must be on x's device {x.device}, got {attention_mask.device}")


def _check_matches_parameters(x, module):
    """x on a device the kernels run on, and of the parameters' device and dtype (unless autocast mixes them)."""
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x is on device {x.device}: {type(module).__name__} runs on CPU and CUDA tensors only "
                         f"(meta and other devices have no selective_ckpt kernels)")
    w = next(module.parameters())
    if w.device != x.device:
        raise ValueError(f"x is on {x.device} but the parameters of {type(module).__name__} are on {w.device}")
    if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"x has dtype {x.dtype} but the parameters of {type(module).__name__} are {w.dtype}: convert "
                        f"one to the other (module.to({x.dtype}) or x.to({w.dtype})), or run under torch.autocast "
                        f"to mix them")


def _attend(qkv, num_heads, causal, dropout_p, attention_mask, seed, softmax_scale, num_kv_heads=None, window=0):
    """Attention over the packed qkv output [B, S, (H + 2 Hkv) * D]; returns [B, S, H * D] without copies."""
    B, S, width = qkv.shape
    num_kv_heads = num_kv_heads or num_heads
    head_dim = width // (num_heads + 2 * num_kv_heads)
    nq, nk = num_heads * head_dim, num_kv_heads * head_dim
    # [B, S, heads * D] slices -> [B, heads, S, D] views with a contiguous last dim; k, v keep Hkv heads.
    q, k, v = (part.unflatten(-1, (-1, head_dim)).transpose(1, 2)
               for part in (qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]))
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    # The layer built q, k, v and drew the seed itself: the op is called without re-checking them.
    o, _ = attention_fwd_op(q, k, v, attention_mask, None, causal, window, float(dropout_p), float(scale),
                            seed if dropout_p > 0 else None)
    return o.view(B, S, nq)  # o is the contiguous [B, S, H, D] buffer


def _draw(p, device):
    return rng.draw_seed_tensor(device) if p > 0 else None


@recomputable
class SelectiveDecoderLayer(nn.Module):
    """Pre-norm decoder layer: x1 = x + dropout(proj(attention(qkv(ln1(x))))), y = x1 + mlp(ln2(x1)).

    norm "layernorm" (nn.LayerNorm, with biases when bias) or "rmsnorm" (nn.RMSNorm); activation
    "gelu" / "gelu_tanh" (fc1, fc2) or "swiglu" / "geglu" (gate_proj, up_proj, down_proj,
    down(act(gate(.)) * up(.))), any with either norm. num_kv_heads < num_heads gives grouped-query
    attention (qkv outputs (H + 2 Hkv) * head_dim; q, k, v are views of it), rope_theta applies
    rotary embeddings to q and k (positions from position_ids, else 0..S-1), sliding_window limits
    each query to the last that many keys. ffn_dim, when given, wins over mlp_ratio.

    `recompute` picks what is kept for backward ("selective", "none", "full"; see the module doc);
    it can be changed at any time (set_recompute). Under no_grad nothing is kept in any mode.
    Each training forward with dropout draws three seeds (attention, proj, MLP) from torch's
    generator as seed tensors (rng.draw_seed_tensor), so torch.compile(fullgraph=True) traces the
    draw too; autograd keeps each seed (8 bytes) instead of a mask.
    """

    def __init__(self, hidden_dim, num_heads, mlp_ratio=4.0, dropout=0.0, attn_dropout=0.0, causal=True,
                 activation="gelu", norm_eps=1e-5, bias=True, recompute="selective", device=None, dtype=None, *,
                 num_kv_heads=None, ffn_dim=None, norm="layernorm", rope_theta=None, sliding_window=None):
        super().__init__()
        self.head_dim, self.num_kv_heads, ffn = check_layer_shape(
            hidden_dim, num_heads, mlp_ratio, num_kv_heads=num_kv_heads, ffn_dim=ffn_dim, norm=norm,
            activation=activation, rope_theta=rope_theta, sliding_window=sliding_window)
        self.gated = activation in GATED_LAYER_ACTIVATIONS
        self.kernel_activation = ACTIVATIONS[activation]
        self.norm, self.ffn_dim = norm, ffn
        self.rope_theta = None if rope_theta is None else float(rope_theta)
        self.sliding_window = sliding_window
        rng.threshold(dropout, "dropout")
        rng.threshold(attn_dropout, "attn_dropout")
        check_bool(causal, "causal")
        check_positive_float(norm_eps, "norm_eps")
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        self.recompute = recompute
        self.engine = None  # the model's keeping.offload.OffloadEngine while a policy offloads (set_recompute)
        self.hidden_dim, self.num_heads, self.causal = hidden_dim, num_heads, causal
        self.dropout, self.attn_dropout, self.activation = float(dropout), float(attn_dropout), activation
        self.softmax_scale = None  # None: 1 / sqrt(head_dim); convert() sets GPT-2's layer-wise scale
        factory = {"device": device, "dtype": dtype}
        if norm == "rmsnorm":
            self.ln1 = nn.RMSNorm(hidden_dim, eps=norm_eps, **factory)
            self.ln2 = nn.RMSNorm(hidden_dim, eps=norm_eps, **factory)
        else:
            self.ln1 = nn.LayerNorm(hidden_dim, eps=norm_eps, bias=bias, **factory)
            self.ln2 = nn.LayerNorm(hidden_dim, eps=norm_eps, bias=bias, **factory)
        qkv_out = (num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv = nn.Linear(hidden_dim, qkv_out, bias=bias, **factory)
        self.proj = nn.Linear(hidden_dim, hidden_dim, bias=bias, **factory)
        if self.gated:
            self.gate_proj = nn.Linear(hidden_dim, ffn, bias=bias, **factory)
            self.up_proj = nn.Linear(hidden_dim, ffn, bias=bias, **factory)
            self.down_proj = nn.Linear(ffn, hidden_dim, bias=bias, **factory)
        else:
            self.fc1 = nn.Linear(hidden_dim, ffn, bias=bias, **factory)
            self.fc2 = nn.Linear(ffn, hidden_dim, bias=bias, **factory)

    @property
    def policy(self):
        """What the layer keeps, offloads and rebuilds (keeping.LayerPolicy); set_recompute sets it."""
        return self._policy

    @policy.setter
    def policy(self, value):
        value = resolve(value)
        self._check_layer_tiles(value.layer_tiles)
        self._policy = value

    @staticmethod
    def _check_layer_tiles(tiles):
        if tiles > 1:
            raise ValueError(f"SelectiveDecoderLayer: the policy's layer_tiles={tiles} applies to converted Hugging "
                             "Face decoder layers; this layer runs its MLP in tiles instead (mlp_tiles)")

    @property
    def recompute(self):
        return self._policy.recompute

    @recompute.setter
    def recompute(self, mode):
        self._policy = resolve(mode, "recompute")

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else dict(self.__dict__)
        state = dict(state)
        state["engine"] = None  # streams and pinned host memory belong to a process: set_recompute makes anew
        return state

    def extra_repr(self):
        llama = ""
        if self.num_kv_heads != self.num_heads or self.norm != "layernorm" or self.rope_theta or self.sliding_window:
            llama = (f"num_kv_heads={self.num_kv_heads}, norm={self.norm!r}, rope_theta={self.rope_theta}, "
                     f"sliding_window={self.sliding_window}, ")
        return (f"hidden_dim={self.hidden_dim}, num_heads={self.num_heads}, {llama}causal={self.causal}, "
                f"activation={self.activation!r}, dropout={self.dropout}, attn_dropout={self.attn_dropout}, "
                f"recompute={str(self.policy)!r}")

    def shape(self):
        """The layer's LayerShape fields (memory.planner), its parameters' dtype included."""
        return dict(hidden_dim=self.hidden_dim, num_heads=self.num_heads, mlp_ratio=self.ffn_dim / self.hidden_dim,
                    dtype=next(self.parameters()).dtype, causal=self.causal, num_kv_heads=self.num_kv_heads,
                    ffn_dim=self.ffn_dim, norm=self.norm, activation=self.activation,
                    sliding_window=self.sliding_window)

    def _dropout_rates(self):
        return (self.attn_dropout, self.dropout) if self.training else (0.0, 0.0)

    def _draw_seeds(self, device):
        """Seeds of the three dropout sites (attention probabilities, proj output, MLP output)."""
        p_attn, p = self._dropout_rates()
        return _draw(p_attn, device), _draw(p, device), _draw(p, device)

    def forward(self, x, attention_mask=None, position_ids=None):
        """x [B, S, hidden]; attention_mask [B, S] bool (True = attend) or None; position_ids [B or 1, S]
        int (rotary positions, used with rope_theta) or None for 0..S-1 -> [B, S, hidden]."""
        _check_input(x, self.hidden_dim, attention_mask, self)
        position_ids = rotary.check_position_ids(position_ids, x)
        seeds = self._draw_seeds(x.device)
        # The fused nodes rebuild what "selective" drops by themselves; the pipeline classifies and offloads
        # (and, under "full", sees only the checkpoint's saved inputs: x).
        with pipeline.scope(self._policy, self.engine, layer_input=x, watch_casts=False, registered=False):
            if self.recompute in CHECKPOINTED and self._needs_graph(x):
                # Seeds are arguments, so the re-run in backward regenerates the very same masks (and the
                # forward's train/eval mode: a site runs dropout iff its seed was drawn, see _block).
                block = self._block if torch.compiler.is_compiling() else self._block_checking_versions(x)
                run = checkpoint if self.recompute == "full" else attention_kept_checkpoint
                return run(block, x, attention_mask, seeds, False, position_ids, use_reentrant=False,
                           preserve_rng_state=False)
            return self._block(x, attention_mask, seeds, self.recompute == "none", position_ids)

    def _block_checking_versions(self, x):
        """_block, whose re-run in backward first checks that neither x nor a parameter was changed in
        place since forward: the re-run would silently use the new values, where the stored modes get
        autograd's saved-tensor version error. The same kind of error is raised here."""
        kept = [("x", x, x._version)] + [(n, p, p._version) for n, p in self.named_parameters()]
        runs = [0]

        def block(*args):
            if runs[0]:
                for name, t, version in kept:
                    if t._version != version:
                        raise RuntimeError(
                            f"one of the variables needed for gradient computation has been modified by an "
                            f"inplace operation: {name} of {type(self).__name__} (recompute='full') is at "
                            f"version {t._version}, expected version {version} as in forward. Modify "
                            f"parameters only after backward (optimizer.step() after loss.backward()).")
            runs[0] += 1
            return self._block(*args)

        return block

    def _needs_graph(self, x):
        """Whether this forward builds an autograd graph (else checkpointing would only keep x alive)."""
        return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))

    @staticmethod
    def _norm_bias(norm):
        return getattr(norm, "bias", None)  # nn.RMSNorm has none

    def _block(self, x, attention_mask, seeds, store, position_ids=None):
        # The forward's rates: a site's seed is drawn iff its rate was on (also for "full"'s re-run).
        p_attn = self.attn_dropout if seeds[0] is not None else 0.0
        p = self.dropout if seeds[1] is not None else 0.0
        norm = {"norm": self.norm, "store": store}
        qkv = norm_fusion.norm_linear(x, self.ln1.weight, self._norm_bias(self.ln1), [(self.qkv.weight, self.qkv.bias)],
                                      eps=self.ln1.eps, **norm)
        if self.rope_theta is not None:
            qkv = rotary.rope_qkv(qkv, position_ids, self.num_heads, self.num_kv_heads, self.head_dim,
                                  self.rope_theta)
        o = _attend(qkv, self.num_heads, self.causal, p_attn, attention_mask, seeds[0], self.softmax_scale,
                    self.num_kv_heads, self.sliding_window or 0)
        a = F.linear(o, self.proj.weight, self.proj.bias)
        if p > 0:
            a = dropout_op(a, p, seeds[1])
        x1 = pipeline.tag(x + a, "residual")
        mlp = (self.gate_proj, self.up_proj, self.down_proj) if self.gated else (self.fc1, self.fc2)
        params = [t for f in mlp for t in (f.weight, f.bias)]
        kind = "gated" if self.gated else "plain"
        tiles = self._policy.mlp_tiles  # read again by "full"'s re-run in backward, which runs _block itself
        if tiles == 1:
            m = norm_fusion.norm_mlp(x1, self.ln2.weight, self._norm_bias(self.ln2), params, eps=self.ln2.eps,
                                     mlp=kind, activation=self.kernel_activation, dropout_p=p, seed=seeds[2], **norm)
            return x1 + m

        def norm_mlp(rows):  # the norm is per token, so tiling x1's rows is exact
            return norm_fusion.norm_mlp(rows, self.ln2.weight, self._norm_bias(self.ln2), params, eps=self.ln2.eps,
                                        mlp=kind, activation=self.kernel_activation, **norm)

        m = tiling.run_in_tiles(norm_mlp, x1, tiles)
        if p > 0:  # on the whole output: the mask of the untiled layer (the stream indexes rows of [B*S, h])
            m = dropout_op(m, p, seeds[2])
        return x1 + m


def set_recompute(model, mode_or_list, every=None, *, engine=None, prefetch=None, host_bytes=None, strict=False):
    """Sets what every SelectiveDecoderLayer and converted Hugging Face decoder layer of `model` keeps (in module
    order); returns the layers' policies (keeping.LayerPolicy, which print as their mode and what they offload).

    - a mode ("selective", "none", "full") or a keeping.LayerPolicy (e.g. keeping.policy("selective",
      offload=["mlp"])): every layer;
    - a list of modes or policies, one per layer (what selective_ckpt.plan and memory.plan return; a plan
      of selective_ckpt.plan also gives the offload engine's prefetch);
    - `every=k` with a mode or policy: "full" on layers 0, k, 2k, ... and that one on the rest (segment
      checkpointing: a full layer every k keeps only its input).

    When a policy offloads, the layers share one offload engine (keeping.offload.OffloadEngine): `engine`, else
    the one the model's layers have, else a new one with `prefetch` (layers reloaded ahead of backward; default
    the plan's, else 1),
    `host_bytes` (its pinned host arena, sized on the first step when None) and `strict` (an error instead of
    pageable memory when pinning fails).
    """
    layers = [state_of(m) for m in recomputable_layers(model)]
    if not layers:
        raise ValueError(f"{type(model).__name__} contains no SelectiveDecoderLayer or converted decoder layer "
                         "(convert it first)")
    if isinstance(mode_or_list, (str, LayerPolicy)):
        single = resolve(mode_or_list, "mode_or_list")
        policies = [single] * len(layers)
        if every is not None:
            check_positive_int(every, "every")
            policies = [resolve("full") if i % every == 0 else single for i in range(len(layers))]
    elif isinstance(mode_or_list, (list, tuple)):
        if every is not None:
            raise ValueError("every applies to a single mode, not to a list of modes")
        policies = [resolve(m, "mode_or_list") for m in mode_or_list]
        if len(policies) != len(layers):
            raise ValueError(f"got {len(policies)} modes for {len(layers)} SelectiveDecoderLayers")
    else:
        raise TypeError(f"mode_or_list must be a mode string, a LayerPolicy or a list of them, got "
                        f"{type(mode_or_list).__name__}")
    for layer, p in zip(layers, policies):  # every refusal before any layer changes
        for check, tiles in (("_mlp_running_in", p.mlp_tiles), ("_check_layer_tiles", p.layer_tiles)):
            if getattr(layer, check, None) is not None:
                getattr(layer, check)(tiles)
    if prefetch is None:
        prefetch = getattr(mode_or_list, "prefetch", 1)
    if any(p.offloaded for p in policies):
        engine = _shared_engine(layers, engine, prefetch, host_bytes, strict)
    elif engine is not None:
        raise ValueError("engine is given but no policy offloads anything")
    for layer, p in zip(layers, policies):
        layer.policy = p
        layer.engine = engine
    return policies


def _shared_engine(layers, engine, prefetch, host_bytes, strict):
    from .keeping.offload import OffloadEngine

    if engine is not None:
        if not isinstance(engine, OffloadEngine):
            raise TypeError(f"engine must be a selective_ckpt.keeping.OffloadEngine, got {type(engine).__name__}")
        return engine
    existing = {id(s.engine): s.engine for s in layers if s.engine is not None}
    if len(existing) == 1:
        return next(iter(existing.values()))
    return OffloadEngine(prefetch=prefetch, host_bytes=host_bytes, strict=strict)


def set_policy(model, policy_or_list, every=None, **offload):
    """set_recompute under the name of what it sets: one keeping.LayerPolicy (or mode) for every layer, or one
    per layer; `offload` takes set_recompute's engine options."""
    return set_recompute(model, policy_or_list, every, **offload)


__all__ = ["SelectiveDecoderLayer", "set_policy", "set_recompute", "RECOMPUTE_MODES"]
