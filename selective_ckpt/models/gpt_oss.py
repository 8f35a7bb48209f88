"""Hugging Face gpt-oss (GptOssForCausalLM): Llama-shaped layers whose attention carries a learned sink per head
(s_aux, passed to selective_ckpt.attention as `sinks`), sliding and full layers by config.layer_types, q/k/v/o
biases; RMSNorms that scale in float32 and round once (each runs its own forward, keeping its input); every MLP a
sparse MoE block (GptOssMLP) of transformers' router (a biased linear, top-k of the logits, softmax over the
top-k) and experts stored as fused, transposed 3-D parameters with biases, gate and up interleaved, and the
clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and |up| <= limit.

The experts run through one autograd node (GptOssRoutedExperts) that keeps each routed row's gate_up output (bias
included) only, as models/moe.py's RoutedExperts does for the other families: the clamped SwiGLU, the down
projection and the routing-weight product are rebuilt in backward; the biases' gradients are each expert's sums.
"""

import torch

from .. import compat
from ..double_backward import first_order_only
from ..keeping import pipeline
from ..memory.estimate import MoE
from ..storages import PLAIN_TENSOR_TYPES
from .checks import check_children, is_class, modules_of
from .errors import ConversionError
from .moe import MoESpec, _in_tiles, _records, _routes, _token_sums, check_expert_layout, grouped_mm_op, routed_call
from .patches import mlp_tiles, tiled_forward
from .spec import GATE_UP_CHILDREN, MLPSpec, NormSpec, llama_shaped

_BLOCK, _EXPERTS, _ROUTER = "GptOssMLP", "GptOssExperts", "GptOssTopKRouter"
# gpt-oss's experts as transformers declares them: [gate, up] interleaved, transposed, with biases
_LAYOUT = {"has_gate": True, "has_bias": True, "is_transposed": True, "is_concatenated": False,
           "has_post_expert_norm": False}


def _acc(t):
    """t in float32, or as it is when wider (float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _gate_product(gu, alpha, limit):
    """GptOssExperts._apply_gate in float32 (float64 for float64): gate and up interleaved along the last dim."""
    gate, up = _acc(gu[:, ::2]).clamp(max=limit), _acc(gu[:, 1::2]).clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def _gate_product_backward(dp, gu, alpha, limit):
    """d(gate_up) of _gate_product for dp, interleaved as gu; a clamp passes gradient where its input lies in its
    closed range, as torch.clamp's backward does."""
    gate_in, up_in = _acc(gu[:, ::2]), _acc(gu[:, 1::2])
    gate, up = gate_in.clamp(max=limit), up_in.clamp(-limit, limit)
    s = torch.sigmoid(alpha * gate)
    dp = _acc(dp)
    dgate = dp * (up + 1) * (s + alpha * gate * s * (1 - s)) * (gate_in <= limit)
    dup = dp * (gate * s) * ((up_in >= -limit) & (up_in <= limit))
    return torch.stack([dgate, dup], dim=-1).flatten(-2)


def _expert_sums(rows, ends):
    """[E, n] in float32 or wider: each expert's sum of its (sorted) rows [S, n]: a segment sum over the group
    lengths (a fixed order, no atomics, no host read), not a matmul, which would add to the layer's matmul work."""
    lengths = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.segment_reduce(_acc(rows), "sum", lengths=lengths, axis=0)


class GptOssRoutedExperts(torch.autograd.Function):
    """y[t] = sum over t's top-k experts e of w * (act(x_t W_gu[e] + b_gu[e]) W_d[e] + b_d[e]); keeps x W_gu + b_gu
    of each routed row (in the matmuls' dtype) besides what the router keeps (weights, index) and x (rebuilt)."""

    @staticmethod
    def forward(ctx, x, gate_up, gate_up_bias, down, down_bias, weights, index, alpha, limit, reduce, dtype):
        k = index.shape[1]
        order, ends = _routes(index, gate_up.shape[0])
        ids = index.reshape(-1)[order]
        gu = grouped_mm_op(x[order // k].to(dtype), gate_up.to(dtype), ends) + gate_up_bias.to(dtype)[ids]
        p = _gate_product(gu, alpha, limit).to(dtype)
        out = (grouped_mm_op(p, down.to(dtype), ends) + down_bias.to(dtype)[ids]) * weights.reshape(-1)[order, None]
        rows = torch.empty_like(out)
        rows[order] = out
        if reduce == "sum":
            y = rows.view(index.shape[0], k, -1).sum(dim=1).to(x.dtype)
        else:
            y = _token_sums(rows, index, x.dtype)
        ctx.alpha, ctx.limit, ctx.dtype = alpha, limit, dtype
        pipeline.tag(gu, "mlp")  # each routed row's gate and up: the MLP's matmul outputs (keeping.policy)
        ctx.save_for_backward(x, gate_up, gate_up_bias, down, down_bias, weights, index, gu)
        return y

    @staticmethod
    @first_order_only("selective_ckpt.models.gpt_oss.GptOssRoutedExperts")
    def backward(ctx, dy):
        x, gate_up, gate_up_bias, down, down_bias, weights, index, gu = ctx.saved_tensors
        need_x, need_gu, need_gub, need_down, need_db, need_w = ctx.needs_input_grad[:6]
        dtype, k = ctx.dtype, index.shape[1]
        order, ends = _routes(index, gate_up.shape[0])
        ids, tok = index.reshape(-1)[order], order // k
        promoted = torch.promote_types(dtype, weights.dtype)
        p = _gate_product(gu, ctx.alpha, ctx.limit).to(dtype)
        w = weights.reshape(-1)[order, None]
        g = dy.contiguous()[tok].to(promoted)
        q = grouped_mm_op(g.to(dtype), down.to(dtype).transpose(1, 2), ends)  # dy_t W_d^T: unweighted
        dx = dgate_up = dgate_up_bias = ddown = ddown_bias = dweights = None
        gw = (g * w).to(dtype)
        if need_w:  # the weight multiplies the down output, bias included
            dw = torch.empty(order.shape, dtype=torch.promote_types(promoted, torch.float32), device=x.device)
            dw[order] = (_acc(q) * _acc(p)).sum(dim=-1) + (_acc(g) * _acc(down_bias)[ids]).sum(dim=-1)
            dweights = dw.to(weights.dtype).view(weights.shape)
        if need_down:
            ddown = grouped_mm_op(p.t(), gw, ends).to(down.dtype)
        if need_db:
            ddown_bias = _expert_sums(gw, ends).to(down_bias.dtype)
        if need_x or need_gu or need_gub:
            dgu = _gate_product_backward(q * w, gu, ctx.alpha, ctx.limit).to(dtype)
            if need_gu:
                dgate_up = grouped_mm_op(x[tok].to(dtype).t(), dgu, ends).to(gate_up.dtype)
            if need_gub:
                dgate_up_bias = _expert_sums(dgu, ends).to(gate_up_bias.dtype)
            if need_x:
                drows = grouped_mm_op(dgu, gate_up.to(dtype).transpose(1, 2), ends)
                flat = torch.empty_like(drows)
                flat[order] = drows
                dx = _token_sums(flat, index, x.dtype)
        return dx, dgate_up, dgate_up_bias, ddown, ddown_bias, dweights, None, None, None, None, None


def experts_forward(self, hidden_states, router_indices, routing_weights):
    """GptOssExperts' forward for every implementation in moe.IMPLEMENTATIONS, keeping each routed row's gate_up
    output; where autograd records nothing, transformers' own."""
    if not _records(self, hidden_states, routing_weights):
        return type(self).forward(self, hidden_states, router_indices, routing_weights)
    reduce, dtype = routed_call(self, hidden_states)
    with torch.autocast(hidden_states.device.type, enabled=False):
        return GptOssRoutedExperts.apply(hidden_states, self.gate_up_proj, self.gate_up_proj_bias, self.down_proj,
                                         self.down_proj_bias, routing_weights, router_indices, float(self.alpha),
                                         float(self.limit), reduce, dtype)


def _rows(block, x):
    _, scores, index = block.router(x)
    return block.experts(x, index, scores)


@tiled_forward
def _block_forward(self, hidden_states):
    """GptOssMLP: transformers' own forward, or with the layer's mlp_tiles > 1 and autograd recording, router and
    experts over sequence tiles (moe._in_tiles); the decoder layer drops the block's second output (the scores)."""
    if mlp_tiles(self) == 1 or not _records(self, hidden_states):
        return type(self).forward(self, hidden_states)
    return _in_tiles(self, hidden_states, _rows), None


class GptOssMoESpec(MoESpec):
    """MoESpec for gpt-oss's block: its router is `router`, its experts biased, transposed and interleaved with
    their own gate (checked here instead of moe.check_experts, which refuses those layouts)."""

    def check_block(self, block, name, model_type, mlp_cls):
        check_children(block, name, self.children, model_type)
        check_children(block.experts, f"{name}.experts", (), model_type)
        check_children(block.router, f"{name}.{self.router_child}", (), model_type)
        if not is_class(block.experts, _EXPERTS) or not is_class(block.router, _ROUTER):
            raise ConversionError(f"{name} (model type {model_type!r}): experts {type(block.experts).__name__} and "
                                  f"router {type(block.router).__name__} must be {_EXPERTS} and {_ROUTER}")
        experts = block.experts
        check_expert_layout(experts, f"{name}.experts", _LAYOUT, "gpt-oss's interleaved, transposed, biased "
                            "experts without post-norm or expert parallelism")
        gate = compat.expert_gate(experts)
        if gate is not None and gate.__qualname__ != f"{_EXPERTS}._apply_gate":
            raise ConversionError(f"{name}.experts: a gate other than {_EXPERTS}._apply_gate cannot be converted")
        for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            t = getattr(experts, p, None)
            if not isinstance(t, torch.nn.Parameter) or type(t) not in PLAIN_TENSOR_TYPES:
                raise ConversionError(f"{name}.experts.{p} is not a plain nn.Parameter; it cannot be converted")
        for setting in ("alpha", "limit"):
            value = getattr(experts, setting, None)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value == value:
                raise ConversionError(f"{name}.experts: swiglu_{setting} = {value!r} is not a number; selective_ckpt "
                                      "reproduces the clamped SwiGLU with a numeric alpha and limit")
        if block.router.weight.shape[0] != experts.num_experts:
            raise ConversionError(f"{name}.router routes {block.router.weight.shape[0]} experts, the block holds "
                                  f"{experts.num_experts}")

    def patches(self, root):
        return [(m, experts_forward) for _, m in modules_of(root, _EXPERTS)]  # the block: the spec's MLP forward

    def memory(self, block):
        """memory.MoE of the block: gpt-oss's router keeps top-k's indices and the softmax over the top-k logits
        (the routing weights) only."""
        return MoE(num_experts=block.experts.num_experts, top_k=block.router.top_k,
                   expert_dim=block.experts.intermediate_size, norm_topk_prob=False, router="topk_softmax")

    def activation(self, block):
        return "swiglu"  # the clamped SwiGLU keeps gate and up as SwiGLU does


# every layer's MLP is the MoE block: the spec's MLP names it with the block's forward (the driver patches it once,
# and checks it as the MoE block it also is)
SPEC = llama_shaped("gpt_oss", "GptOss", norm=NormSpec("rmsnorm", "GptOssRMSNorm", rounding="float32_scale"),
                    mlp=MLPSpec(_BLOCK, "gate_up", GATE_UP_CHILDREN, forward=_block_forward),
                    moe=GptOssMoESpec(_BLOCK, ("router", "experts"), _EXPERTS, _ROUTER, block_forward=_block_forward,
                                      router_child="router"))
