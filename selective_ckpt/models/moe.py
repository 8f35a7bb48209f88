"""Sparse mixture-of-experts MLPs of Hugging Face models (the specs with `ModelSpec.moe`), converted in place.

transformers stores a layer's experts as two 3-D parameters (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) and picks the experts' forward by `config._experts_implementation` ("eager" loops over the
hit experts, "grouped_mm" and "batched_mm" run them as grouped or batched matmuls). Each of them
keeps, per routed row (t*top_k rows for t tokens), the gathered input, the gate and up outputs, act(gate),
the product and the expert's down output for the routing-weight product. The patched experts forward
(`experts_forward`) computes the same function through one autograd node (`RoutedExperts`) that keeps
only the gate and up outputs of every routed row (besides the routing weights and indices the
router keeps anyway, and the experts' input, a norm output that is rebuilt): act(gate) * up is rebuilt
in backward, and the weighted down projection is differentiated without its output, since for a row r
of token t with weight w_r, product p_r and q_r = dy_t @ W_down:
    dL/dw_r = q_r . p_r,   dL/dp_r = w_r * q_r,   dL/dW_down = sum_r (w_r dy_t) p_r^T,
one matmul of dy against W_down per row block, as the unconverted backward does.

Routing stays on the device: the routed rows are sorted by expert (a stable sort of the flat index), each
expert's rows end where `searchsorted` of the sorted ids says, and the matmuls run as grouped matmuls over
those offsets (`selective_ckpt::grouped_mm`: torch's grouped matmul where it has a kernel, float32 / bf16 /
fp16 on CPU; otherwise one matmul per group with the offsets read on the host, as float64 does). Nothing
is read on the host, so a layer makes no device->host sync and torch.compile(fullgraph=True) traces it
(the op has a fake kernel for every dtype). Each row's products are those of a per-expert loop (on CPU,
bit for bit), and the sums follow each implementation's own order: "eager" adds each expert's weighted
rows into zeros in the hidden states' dtype, expert by expert (so a token's rows are added in ascending
expert order, as here), and computes under autocast in autocast's dtype; "grouped_mm" and "batched_mm" sum
a token's top-k rows in the promoted dtype, and "grouped_mm" computes in the weights' dtype (its kernel
ignores autocast). Where autograd records nothing (no_grad, inference) transformers' own experts (and
Qwen2-MoE's own block) run, whichever implementation the config names. Any other implementation, expert
parallelism, biased, transposed, interleaved or non-gated expert layouts are refused by name.

The router (transformers' own module and forward) is left as it is, so its logits, top-k and the
auxiliary load-balancing loss are transformers'. Where the layer's policy runs the MLP in sequence tiles
(keeping.policy(..., mlp_tiles=n) under "full" and "attention-kept"), the block runs router and experts tile by
tile, each tile under its own checkpoint (keeping.tiling), so a layer's forward and its rebuild hold one tile's
routed rows ([tokens/n * top_k, 2I]) instead of all of them; routing is per token, so each token's output is
computed from its own row, exact up to the rounding of matmuls over fewer rows. The router is then called once per
tile: the logits transformers collects for the auxiliary loss (output_router_logits) are concatenated back into
the layer's one [B*S, E] tensor in its (batch, token) order, so the loss, its padding mask and
`router_logits` read as untiled (up to that rounding); a hook on the router sees one call per tile. Qwen2-MoE's
shared expert (a gated MLP) and its sigmoid gate: y = down(sigmoid(g(x)) * act(gate) * up), the gate folded into
the down projection's input (rebuilt, like the product) instead of scaling the down output, which would keep t*h
elements.
"""

import contextlib
import dataclasses
import threading

import torch

from .. import compat
from ..activations import has_own_hooks, kernel_activation
from ..double_backward import first_order_only
from ..keeping import pipeline, tiling
from ..memory.estimate import MoE
from ..ops.gated_mlp import gated_product_backward_op, gated_product_op, gated_product_rebuild_op
from ..storages import PLAIN_TENSOR_TYPES
from .checks import check_children, is_class, modules_of
from .errors import ConversionError
from .patches import activate, mlp_tiles, tiled_forward

# experts implementation -> (how a token's rows are summed, the matmuls' dtype rule)
IMPLEMENTATIONS = {"eager": ("index_add", "autocast"), "grouped_mm": ("sum", "weight"),
                   "batched_mm": ("sum", "autocast")}


def _autocast_dtype(device_type):
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _cpu_grouped_kernel():
    """torch's grouped matmul where it has a CPU kernel (torch >= 2.9), else None."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    if fn is None and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9):
        fn = getattr(torch, "_grouped_mm", None)
    return fn


def _grouped_kernel(a, b):
    """torch's grouped matmul for these operands, or None where it has no kernel for them (float64, strides
    that are not multiples of 16 bytes, CPU before torch 2.9, CUDA before sm80)."""
    if a.dtype not in (torch.float32, torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        return None
    if any(s != 1 and n != 1 and s * t.element_size() % 16 for t in (a, b) for s, n in zip(t.stride(), t.shape)):
        return None
    if a.device.type == "cuda":
        if torch.cuda.get_device_capability(a.device) < (8, 0):
            return None
        return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if a.device.type == "cpu":
        return _cpu_grouped_kernel()
    return None


@torch.library.custom_op("selective_ckpt::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Row groups ending at `ends` (int32, on a's device, last = a's grouped extent):
    a [S, K] x b [G, K, N] -> [S, N], rows of group g times b[g];
    a [M, S] x b [S, N] -> [G, M, N], group g's columns of a times its rows of b (zeros for an empty group).
    torch's grouped matmul where it has a kernel (the offsets stay on the device); otherwise one matmul per
    group, the offsets read on the host. An op of its own so torch.compile sees its shapes for every dtype
    (torch's grouped matmul traces in bfloat16 only)."""
    kernel = _grouped_kernel(a, b)
    if kernel is not None:
        return kernel(a, b, offs=ends)
    start = 0
    if b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[2])
        for g, end in enumerate(ends.tolist()):
            if end > start:
                out[start:end] = torch.mm(_aligned(a[start:end]), b[g])
            start = end
        return out
    out = a.new_zeros(ends.shape[0], a.shape[0], b.shape[1])
    for g, end in enumerate(ends.tolist()):
        if end > start:
            out[g] = torch.mm(_aligned(a[:, start:end]), _aligned(b[start:end]))
        start = end
    return out


def _aligned(t):
    """t, or a copy of it (same strides) at an address BLAS takes the same path for as for a fresh tensor: CPU
    BLAS rounds products of misaligned operands and outputs differently (float64 rows at 8-byte offsets), so
    each group's product is computed from aligned operands into a fresh output, then copied."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


@grouped_mm_op.register_fake
def _(a, b, ends):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(ends.shape[0], a.shape[0], b.shape[1])


def _grouped_mm_flops(a_shape, b_shape, ends_shape, *args, out_shape=None, **kwargs):
    """torch.utils.flop_counter's count: each routed row (or, [M, S] x [S, N], each column of a) once."""
    if len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


try:
    from torch.utils.flop_counter import register_flop_formula
except ImportError:  # an older torch counts no custom op
    pass
else:
    register_flop_formula(torch.ops.selective_ckpt.grouped_mm)(_grouped_mm_flops)


def _routes(index, num_experts):
    """(order, ends) of a [tokens, top_k] index: the flat positions sorted by expert (stable, so forward and
    backward walk the same rows in the same order) and, per expert, where its rows end, as an int32 tensor on
    the index's device. Nothing is read on the host."""
    flat = index.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=flat.dtype)
    return order, torch.searchsorted(ids, bounds).to(torch.int32)


def _token_sums(rows, index, dtype):
    """sum over each token's top_k rows ([tokens * top_k, h], flat order), in `dtype`, the rows added into
    zeros one at a time in ascending expert order: what transformers' "eager" loop's index_add_ computes."""
    n, k = index.shape
    ranked = torch.argsort(index, dim=1, stable=True)
    rows = rows.view(n, k, -1).to(dtype)
    out = torch.zeros(n, rows.shape[-1], dtype=dtype, device=rows.device)
    for j in range(k):
        out = out + rows.gather(1, ranked[:, j, None, None].expand(n, 1, rows.shape[-1])).squeeze(1)
    return out


class RoutedExperts(torch.autograd.Function):
    """y[t] = sum over t's top-k experts e of w * down_e(act(gate_e(x_t)) * up_e(x_t)); keeps gate and up.
    With `scale_input` the weight scales the expert's input instead (Llama 4's router):
    y[t] = sum_e down_e(act(gate_e(w x_t)) * up_e(w x_t)); the scaled rows are rebuilt from x and w in backward.

    The routed rows run sorted by expert through grouped matmuls whose group ends stay on the device, so
    neither forward nor backward reads the routing on the host."""

    @staticmethod
    def forward(ctx, x, gate_up, down, weights, index, activation, reduce, dtype, scale_input=False):
        k = index.shape[1]
        inter = down.shape[2]
        order, ends = _routes(index, gate_up.shape[0])
        w = weights.reshape(-1)[order, None]
        routed = x[order // k] * w if scale_input else x[order // k]
        gu = grouped_mm_op(routed.to(dtype), gate_up.to(dtype).transpose(1, 2), ends)
        p = gated_product_op(gu[:, :inter], gu[:, inter:], activation)
        out = grouped_mm_op(p, down.to(dtype).transpose(1, 2), ends)
        if not scale_input:
            out = out * w
        rows = torch.empty_like(out)
        rows[order] = out
        if reduce == "sum":
            y = rows.view(index.shape[0], k, -1).sum(dim=1).to(x.dtype)
        else:
            y = _token_sums(rows, index, x.dtype)
        ctx.activation, ctx.dtype, ctx.scale_input = activation, dtype, scale_input
        pipeline.tag(gu, "mlp")  # each routed row's gate and up: the MLP's matmul outputs (keeping.policy)
        ctx.save_for_backward(x, gate_up, down, weights, index, gu)
        return y

    @staticmethod
    @first_order_only("selective_ckpt.models.moe.RoutedExperts")
    def backward(ctx, dy):
        x, gate_up, down, weights, index, gu = ctx.saved_tensors
        need_x, need_gu, need_down, need_w = ctx.needs_input_grad[:4]
        dtype, act = ctx.dtype, ctx.activation
        k = index.shape[1]
        inter = down.shape[2]
        order, ends = _routes(index, gate_up.shape[0])
        tok = order // k
        promoted = torch.promote_types(dtype, weights.dtype)
        gate, up = gu[:, :inter].contiguous(), gu[:, inter:].contiguous()
        p = gated_product_rebuild_op(gate, up, act)
        w = weights.reshape(-1)[order, None]
        g = dy.contiguous()[tok].to(promoted)
        q = grouped_mm_op(g.to(dtype), down.to(dtype), ends)  # dy_t @ W_down: the down output's gradient, unweighted
        dx = dgate_up = ddown = dweights = None
        scaled = ctx.scale_input
        if need_w and not scaled:
            dw = torch.empty(order.shape, dtype=torch.float32, device=x.device)
            dw[order] = (q.float() * p.float()).sum(dim=-1)
            dweights = dw.to(weights.dtype).view(weights.shape)
        if need_down:
            ddown = grouped_mm_op((g if scaled else g * w).to(dtype).t(), p, ends).to(down.dtype)
        if need_x or need_gu or (need_w and scaled):
            dgate = q.to(dtype) if scaled else (q * w).to(dtype)
            dup = gated_product_backward_op(dgate, gate, up, act)
            dpart = torch.cat([dgate, dup], dim=-1)
            if need_gu:
                routed = x[tok] * w if scaled else x[tok]  # the experts' input rows, rebuilt
                dgate_up = grouped_mm_op(dpart.t(), routed.to(dtype), ends).to(gate_up.dtype)
            if need_x or (need_w and scaled):
                drows = grouped_mm_op(dpart, gate_up.to(dtype), ends)
                if need_w and scaled:  # the weight multiplies the input row: dL/dw_r = drows_r . x_t
                    acc = torch.promote_types(drows.dtype, torch.float32)  # float32, or float64 for float64
                    dw = torch.empty(order.shape, dtype=acc, device=x.device)
                    dw[order] = (drows.to(acc) * x[tok].to(acc)).sum(dim=-1)
                    dweights = dw.to(weights.dtype).view(weights.shape)
                if need_x:
                    drows = drows * w if scaled else drows
                    flat = torch.empty_like(drows)
                    flat[order] = drows
                    dx = _token_sums(flat, index, x.dtype)
        return dx, dgate_up, ddown, dweights, None, None, None, None, None


_routing = threading.local()


@contextlib.contextmanager
def even_routing():
    """While active, the routed rows are taken as split evenly between the experts, whatever the index says:
    for a step simulated on fake tensors (selective_ckpt.fit), which hold no index to count. The converted
    experts read no counts (their routing stays on the device and runs on fake tensors as it is); the flag is
    for simulated transformers experts (fit.simulate)."""
    previous = getattr(_routing, "even", False)
    _routing.even = True
    try:
        yield
    finally:
        _routing.even = previous


def even_counts(rows, num_experts):
    """`rows` split as evenly as they go between `num_experts` experts, the first ones taking one more."""
    return [rows // num_experts + (e < rows % num_experts) for e in range(num_experts)]


def implementation_of(experts):
    impl = compat.experts_implementation(experts.config)
    return "eager" if impl is None else impl


def _records(module, *inputs):
    """Whether autograd records this call: grad mode on and an input or a parameter of `module` requiring a
    gradient. Where it does not, nothing would be kept, and transformers' own forward runs."""
    return torch.is_grad_enabled() and (any(t.requires_grad for t in inputs) or
                                        any(p.requires_grad for p in module.parameters()))


def compute_dtype(experts, hidden_states, rule="input"):
    """The dtype an experts module's matmuls run in: its weights' (`rule` "weight"), else autocast's or the hidden
    states'; a ValueError where hidden states and weights differ outside autocast (transformers' own forward would
    fail there too)."""
    autocast = _autocast_dtype(hidden_states.device.type)
    if rule == "weight":
        return experts.gate_up_proj.dtype
    if autocast is None and experts.gate_up_proj.dtype != hidden_states.dtype:
        raise ValueError(f"{type(experts).__name__}: hidden states {hidden_states.dtype} and expert weights "
                         f"{experts.gate_up_proj.dtype} differ outside autocast")
    return autocast or hidden_states.dtype


def routed_call(experts, hidden_states):
    """(reduce, dtype) of a recording experts call under the implementation the config names (IMPLEMENTATIONS), or
    the ValueError naming the implementations we reproduce."""
    impl = implementation_of(experts)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{type(experts).__name__}: experts implementation {impl!r} is not supported by "
                         f"selective_ckpt (supported: {', '.join(IMPLEMENTATIONS)}); choose one with "
                         "model.set_experts_implementation(...)")
    reduce, rule = IMPLEMENTATIONS[impl]
    return reduce, compute_dtype(experts, hidden_states, rule)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts' forward for every implementation in IMPLEMENTATIONS, keeping each routed row's gate and up.
    Where autograd records nothing (no_grad, inference, nothing requiring a gradient) nothing is kept, and
    transformers' own experts forward runs, whichever implementation the config names."""
    if not _records(self, hidden_states, top_k_weights):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    reduce, dtype = routed_call(self, hidden_states)
    kernel = kernel_activation(self.act_fn)
    with torch.autocast(hidden_states.device.type, enabled=False):
        return RoutedExperts.apply(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index,
                                   kernel, reduce, dtype, False)


# the layout transformers' experts modules declare by flags, as experts_forward reproduces it
CONCATENATED_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                       "has_post_expert_norm": False}


def check_expert_layout(experts, name, layout, described):
    """ConversionError unless `experts` runs an implementation we reproduce, declares `layout` ({flag: value}) and
    runs without expert parallelism; `described` names the layout that converts."""
    impl = implementation_of(experts)
    if impl not in IMPLEMENTATIONS:
        raise ConversionError(f"{name}: experts implementation {impl!r} cannot be converted (selective_ckpt "
                              f"reproduces {', '.join(IMPLEMENTATIONS)}); load the model with "
                              "experts_implementation='grouped_mm' or 'eager'")
    wrong = [f"{f}={getattr(experts, f, None)!r}" for f, want in layout.items() if getattr(experts, f, want) != want]
    if compat.is_expert_parallel(experts):
        wrong.append("expert parallelism")
    if wrong:
        raise ConversionError(f"{name}: experts with {', '.join(wrong)} cannot be converted; selective_ckpt converts "
                              f"{described}")


def check_experts(experts, name):
    """ConversionError unless `experts` is a layout and implementation experts_forward reproduces."""
    check_expert_layout(experts, name, CONCATENATED_LAYOUT, "concatenated [gate; up] experts without bias, "
                        "transposition, post-norm or expert parallelism")
    if compat.has_own_expert_gating(experts):
        raise ConversionError(f"{name}: experts with their own gating ({type(experts).__name__}._apply_gate) cannot "
                              "be converted")
    for p in ("gate_up_proj", "down_proj"):
        w = getattr(experts, p, None)
        if not isinstance(w, torch.nn.Parameter) or type(w) not in PLAIN_TENSOR_TYPES:  # a fake one is plain too
            raise ConversionError(f"{name}.{p} is not a plain nn.Parameter; it cannot be converted")
    if kernel_activation(experts.act_fn) is None:
        raise ConversionError(f"{name}.act_fn ({type(experts.act_fn).__name__}) is not an activation selective_ckpt "
                              "rebuilds inside the experts (silu, gelu, gelu_tanh without hooks of their own)")


# --- The sparse MoE blocks: transformers' own forward, or over sequence tiles (keeping.tiling) when the layer's
# policy asks for mlp_tiles > 1.

def _router_logits():
    """The list transformers' output capturing appends each router call's logits to in this forward (a model
    called with output_router_logits), or None where no logits are collected."""
    collected = compat.active_output_collector()
    return None if collected is None else collected.get("router_logits")


def _in_tiles(block, hidden_states, rows_of):
    """rows_of(block, rows) -> the block's output rows, run over the block's MLP_TILES sequence tiles of
    hidden_states [B, S, h] (keeping.tiling: each tile, router and experts, under its own checkpoint).

    Routing is per token, so each token's output comes from its own row (exact up to the rounding of matmuls
    over fewer rows). The router runs once per tile: where its logits are collected for the auxiliary loss, the
    tiles' logits are concatenated into the one [B*S, E] tensor of the layer, in transformers' (batch, token)
    order, so the loss and `router_logits` have the untiled shapes and values (up to that rounding)."""
    batch, _, hidden = hidden_states.shape
    logits = _router_logits()
    start = None if logits is None else len(logits)

    def tile(t):
        return rows_of(block, t.reshape(-1, hidden)).view(t.shape)

    out = tiling.run_in_tiles(tile, hidden_states, mlp_tiles(block))
    if logits is not None and len(logits) - start > 1:
        tiles = logits[start:]
        del logits[start:]
        experts = tiles[0].shape[-1]
        logits.append(torch.cat([t.view(batch, -1, experts) for t in tiles], dim=1).view(-1, experts))
    return out


def _routed_rows(block, x):
    _, routing_weights, selected_experts = block.gate(x)
    return block.experts(x, selected_experts, routing_weights)


@tiled_forward
def routed_block_forward(self, hidden_states):
    """A sparse MoE block of router and experts (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock): transformers' own
    forward, or with the layer's mlp_tiles > 1 and autograd recording, router and experts over sequence tiles
    (_in_tiles)."""
    if mlp_tiles(self) == 1 or not _records(self, hidden_states):
        return type(self).forward(self, hidden_states)
    noise = getattr(self, "jitter_noise", 0) or 0
    if self.training and noise > 0:
        raise ValueError(f"{type(self).__name__}: router_jitter_noise={noise} multiplies the experts' input in place "
                         "in training, which selective_ckpt cannot rebuild; set it to 0")
    return _in_tiles(self, hidden_states, _routed_rows)


# --- Qwen2-MoE's block: routed experts plus a shared expert scaled by a sigmoid gate.

def _scaled(scale, p):
    return scale * p


def _shared_expert_rows(self, x):
    se = self.shared_expert
    _, routing_weights, selected_experts = self.gate(x)
    routed = self.experts(x, selected_experts, routing_weights)
    scale = torch.sigmoid(self.shared_expert_gate(x))
    if has_own_hooks(se):
        shared = scale * se(x)
    else:
        p = activate(se.act_fn, se.gate_proj(x), se.up_proj(x))
        sp = pipeline.discardable(_scaled(scale, p), _scaled, scale, pipeline.source(p))
        shared = se.down_proj(sp)
    return routed + shared


@tiled_forward
def shared_expert_block_forward(self, hidden_states):
    """Qwen2MoeSparseMoeBlock: experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x), the sigmoid
    applied to the shared expert's product before its down projection (rebuilt, so only gate, up and the
    sigmoid's output are kept). A shared expert with hooks of its own is called as a module instead. With the
    layer's mlp_tiles > 1, over sequence tiles (_in_tiles). Where autograd records nothing, transformers' own
    block forward runs."""
    if not _records(self, hidden_states):
        return type(self).forward(self, hidden_states)
    if mlp_tiles(self) > 1:
        return _in_tiles(self, hidden_states, _shared_expert_rows)
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    out = _shared_expert_rows(self, hidden_states.view(-1, hidden_dim))
    return out.reshape(batch_size, sequence_length, hidden_dim)


# --- The family description the driver reads (spec.ModelSpec.moe).

@dataclasses.dataclass(frozen=True)
class MoESpec:
    block: str  # the sparse MoE block's class name
    children: tuple  # the block's children
    experts: str  # the experts' class name
    router: str  # the router's class name
    block_forward: object = None  # the block's patched forward; None: routed_block_forward (router and experts)
    shared: bool = False  # a shared expert (gated MLP of the spec's MLP class) and its sigmoid gate
    check: object = None  # extra checks (block, name) raising ConversionError
    weights_dtype: object = None  # the routing weights' dtype (Mixtral's stay float32), None: the router logits'
    router_child: str = "gate"  # the block's router child (of class `router`)
    # a shared expert added without a gate (GLM-4.5's "shared_experts", a gated MLP the spec's check verifies): its
    # child; None: none, or Qwen2-MoE's gated one (`shared`)
    ungated_shared: str = None
    scalars: int = 0  # products by a Python float in the block (GLM-4.5's routed_scaling_factor), 8 bytes each

    def check_block(self, block, name, model_type, mlp_cls):
        router = getattr(block, self.router_child, None)
        check_children(block, name, self.children, model_type)
        check_children(block.experts, f"{name}.experts", ("act_fn",), model_type)
        check_children(router, f"{name}.{self.router_child}", (), model_type)
        if not is_class(block.experts, self.experts) or not is_class(router, self.router):
            raise ConversionError(f"{name} (model type {model_type!r}): experts {type(block.experts).__name__} and "
                                  f"{self.router_child} {type(router).__name__} must be {self.experts} and "
                                  f"{self.router}")
        if self.shared:
            if not is_class(block.shared_expert, mlp_cls):
                raise ConversionError(f"{name}.shared_expert is a {type(block.shared_expert).__name__}, not {mlp_cls}")
            gate = getattr(block.shared_expert_gate, "base_layer", block.shared_expert_gate)  # LoRA keeps its base
            # called as a module: a plain Linear or a bitsandbytes 4-/8-bit one (QLoRA quantizes it too)
            linear = type(gate) is torch.nn.Linear or (isinstance(gate, torch.nn.Linear) and
                                                      compat.is_quantized_linear(gate))
            if not linear or gate.bias is not None:
                raise ConversionError(f"{name}.shared_expert_gate is not a bias-free nn.Linear (plain, 4- or 8-bit); "
                                      "it cannot be converted")
        check_experts(block.experts, f"{name}.experts")
        if self.check is not None:
            self.check(block, name)

    def memory(self, block):
        """memory.MoE of a converted block: its experts, top-k and widths, its shared expert's width."""
        experts, router = block.experts, getattr(block, self.router_child)
        shared = (block.shared_expert if self.shared else getattr(block, self.ungated_shared)
                  if self.ungated_shared else None)
        shared_dim = 0 if shared is None else getattr(shared.gate_proj, "base_layer", shared.gate_proj).out_features
        return MoE(num_experts=experts.num_experts, top_k=router.top_k, expert_dim=experts.intermediate_dim,
                   weights_dtype=self.weights_dtype, norm_topk_prob=bool(getattr(router, "norm_topk_prob", True)),
                   shared_dim=shared_dim, shared_gate=not self.ungated_shared)

    def activation(self, block):
        """The LayerShape activation of the experts: each routed row keeps gate and up ("swiglu" for SiLU)."""
        return "swiglu" if kernel_activation(block.experts.act_fn) == "silu" else "geglu"

    def patches(self, root):
        out = [(m, experts_forward) for _, m in modules_of(root, self.experts)]
        block_forward = self.block_forward or routed_block_forward
        return out + [(m, block_forward) for _, m in modules_of(root, self.block)]


def refuse_jitter(block, name):
    noise = getattr(block, "jitter_noise", 0) or 0
    if noise > 0:
        raise ConversionError(f"{name}: router_jitter_noise={noise} multiplies the experts' input in place in "
                              "training, which selective_ckpt cannot rebuild; convert with router_jitter_noise=0")
