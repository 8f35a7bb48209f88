"""The replacement forwards for Hugging Face norms, MLP activations and dropouts.

Modules, parameters and names stay; only `forward` of the instance is replaced (models/patching.py).
Each patched forward keeps what its own backward needs (a norm: its input and statistics; an activation: its
input(s)) and hands its output to `keeping.discardable`, so whatever consumes the output (a
Linear, a LoRA layer, a quantized Linear) keeps a placeholder instead, rebuilt once in backward.
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from .. import rng
from ..activations import GELU_APPROXIMATE, has_own_hooks, kernel_activation
from ..double_backward import first_order_only
from ..keeping import pipeline, tiling
from ..ops.dropout import dropout_op
from ..ops.gated_mlp import gated_product, gated_product_op
from ..ops.gelu_mlp import gelu_backward_op, gelu_op
from ..ops.layer_norm import layer_norm_apply, layer_norm_fwd
from ..ops.rms_norm import rms_norm_apply, rms_norm_fwd
from .patching import PATCHED


def rebuilt_in_backward(fn, *args):
    """fn(*args), a norm's or activation's differentiable output; in a compiled forward whose layer rebuilds those
    (pipeline.compiled_rebuilds), in a checkpoint region, so the compiled backward recomputes it from args as the
    eager pipeline rebuilds it."""
    if pipeline.compiled_rebuilds():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def rms_eps(norm):
    """An RMSNorm module's epsilon, by either of the names transformers' norms give it."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def norm_input(x, kept):
    """Names the class of a norm's input (keeping.policy) unless one was named before: the layer input x stays
    "input"; x1 and the post-norms' inputs are "residual"; a q/k norm's input (a q or k projection output) is
    "qkv" (its patch is given kept="qkv")."""
    pipeline.tag(x, kept, if_untagged=True)


# --- LayerNorm (GPT-2): the fused kernel keeps x, mean, rstd; the output is rebuilt from them.

def layer_norm_forward(self, x, kept="residual"):
    """nn.LayerNorm, or a LayerNorm without bias that holds `variance_epsilon` (CohereLayerNorm, which computes
    in fp32 and rounds once: a weight of another dtype than x runs its own forward, rounding as it does).
    `kept`: the class of x when nothing named one before (norm_input)."""
    norm_input(x, kept)
    bias = getattr(self, "bias", None)
    if not isinstance(self, torch.nn.LayerNorm) and (self.weight.dtype != x.dtype or self.weight.shape != x.shape[-1:]):
        return getattr(self, PATCHED)(x)
    w = self.weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    eps = self.eps if hasattr(self, "eps") else self.variance_epsilon
    if pipeline.compiled_rebuilds():
        return rebuilt_in_backward(lambda x, w, b: layer_norm_fwd(x, w, b, float(eps))[0], x, w, b)
    y, mean, rstd = layer_norm_fwd(x, w, b, float(eps))
    return pipeline.discardable(y, layer_norm_apply, x, w, b, mean, rstd)


# --- RMSNorm (every spec's NormSpec "rmsnorm", q/k norms included): the fused kernel in Hugging Face's rounding
# order for the offset (ops/rms_norm.py); keeps x and the fp32 rstd, the output is rebuilt from them.

def rms_norm_forward(self, x, offset=0.0, kept="residual"):
    """y = x * rstd * (offset + weight); a model spec's norm offset arrives through functools.partial."""
    norm_input(x, kept)
    eps = rms_eps(self)
    if self.weight.dtype == x.dtype:
        if pipeline.compiled_rebuilds():
            return rebuilt_in_backward(lambda x, w: rms_norm_fwd(x, w, eps, offset)[0], x, self.weight)
        y, rstd = rms_norm_fwd(x, self.weight, eps, offset)
        return pipeline.discardable(y, rms_norm_apply, x, self.weight, rstd, offset)
    if offset:
        # a (1 + w) norm with a weight of another dtype: computed as transformers does
        return getattr(self, PATCHED)(x)
    # A weight of another dtype (fp32 norms after peft's prepare_model_for_kbit_training, or kept in
    # fp32 by the user): transformers rounds the normalised row to x's dtype and multiplies by the
    # weight in the promoted dtype. The kernel gives the rounded row (times 1, exact); the product
    # is one eager multiply whose output is rebuilt like the norm's.
    ones = torch.ones(self.weight.shape, dtype=x.dtype, device=x.device)
    n, rstd = rms_norm_fwd(x, ones, eps, 0.0)
    n = pipeline.discardable(n, rms_norm_apply, x, ones, rstd, 0.0)
    y = self.weight * n
    return pipeline.discardable(y, _weighted_rms_norm, x, ones, rstd, self.weight)


def _weighted_rms_norm(x, ones, rstd, weight):
    return weight * rms_norm_apply(x, ones, rstd, 0.0)


def weightless_rms_norm_forward(self, x, kept="qkv"):
    """T(x * rstd), an RMSNorm without a weight (Llama 4's q/k norm: x.float() normalised, rounded to x's dtype
    once): the kernel with a row of ones as its weight (a product by 1, exact), which it keeps with x and the fp32
    rstd; the output is rebuilt from them."""
    norm_input(x, kept)
    eps = rms_eps(self)
    ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    if pipeline.compiled_rebuilds():
        return rebuilt_in_backward(lambda x, w: rms_norm_fwd(x, w, eps, 0.0)[0], x, ones)
    n, rstd = rms_norm_fwd(x, ones, eps, 0.0)
    return pipeline.discardable(n, rms_norm_apply, x, ones, rstd, 0.0)


# --- A norm in a rounding order the kernels do not have (OLMo2's T(w * (x * rstd)), scaled in float32 and
# rounded once): the module's own forward, in an autograd node that keeps x only and runs that forward again
# under autograd in backward (the statistics are recomputed with it); the output is rebuilt from x.

def own_forward_norm(self, x, kept="residual"):
    """The norm's original forward, bit for bit, keeping its input only (see _ModuleActivation)."""
    norm_input(x, kept)
    out = _ModuleActivation.apply(self, x, None, *self.parameters())
    return pipeline.discardable(out, _module_product, self, x, None)


# --- Activations: the module's own activation, through the kernels when it is one of theirs.

class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, approximate):
        ctx.approximate = approximate
        ctx.save_for_backward(h)
        return gelu_op(h, approximate)

    @staticmethod
    @first_order_only("selective_ckpt.models.patches.gelu")
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        dh = da.contiguous().clone()
        gelu_backward_op(dh, h, ctx.approximate)
        return dh, None


def gelu(h, approximate):
    a = rebuilt_in_backward(lambda h: _GELU.apply(h, approximate), h)
    return pipeline.discardable(a, gelu_op, h.contiguous(), approximate)


def _own(module):
    """The module's own forward: the original one of a patched module (own_forward_norm), else module.forward."""
    return getattr(module, PATCHED, None) or module.forward


class _ModuleActivation(torch.autograd.Function):
    """act(h) (times up) by an activation module's own forward, keeping h (and up) only: backward runs
    the forward again under autograd. An activation that saves its output (ReLU) would keep it otherwise."""

    @staticmethod
    def forward(ctx, module, h, up, *params):
        ctx.module = module
        ctx.save_for_backward(h, up)
        a = _own(module)(h)
        return a if up is None else a * up

    @staticmethod
    @first_order_only("selective_ckpt.models.patches.activate")
    def backward(ctx, grad):
        h, up = ctx.saved_tensors
        needs = ctx.needs_input_grad
        params = [p for p, need in zip(ctx.module.parameters(), needs[3:]) if need]
        with torch.enable_grad():
            h_ = h.detach().requires_grad_(needs[1])
            a = _own(ctx.module)(h_)
        inputs = ([h_] if needs[1] else []) + params
        dup = grad * a.detach() if up is not None and needs[2] else None
        da = grad if up is None else grad * up
        grads = list(torch.autograd.grad(a, inputs, da, allow_unused=True)) if inputs else []
        dh = grads.pop(0) if needs[1] else None
        dparams = iter(grads)
        return (None, dh, dup, *(next(dparams) if need else None for need in needs[3:]))


def _module_product(module, h, up):
    with torch.no_grad():
        a = _own(module)(h)
        return a if up is None else a * up


def activate(act_fn, h, up=None):
    """act_fn(h), or act_fn(h) * up for a gated MLP, as the next Linear's input, registered to be rebuilt.

    A kernel activation module (activations.kernel_activation) runs the fused kernels, which keep h
    (and up). Any other elementwise activation module runs its own forward in an autograd node that
    keeps h (and up) and is rebuilt from them; with hooks of its own it is called as a module (its
    hooks run) and its output is kept (a hook may have changed it), only the product is rebuilt.
    """
    pipeline.tag(h, "mlp")  # the MLP's matmul outputs (keeping.policy's classes)
    if up is not None:
        pipeline.tag(up, "mlp")
    kernel = kernel_activation(act_fn)
    if kernel is not None and (up is not None or kernel in GELU_APPROXIMATE):  # no plain-SiLU kernel
        if up is None:
            return gelu(h, GELU_APPROXIMATE[kernel])
        p = rebuilt_in_backward(functools.partial(gated_product, activation=kernel), h, up)
        return pipeline.discardable(p, gated_product_op, h, up, kernel)
    if has_own_hooks(act_fn):
        a = act_fn(h)
        return a if up is None else pipeline.discardable(a * up, torch.mul, a, up)
    out = _ModuleActivation.apply(act_fn, h, up, *act_fn.parameters())
    return pipeline.discardable(out, _module_product, act_fn, h, up)


# --- The gated MLP (Llama-shaped models): act(gate) * up, keeping gate and up.

# The tile count of a converted layer's MLP (keeping.tiling): set on the MLP module by its layer's policy
# (models/converted_layer.py), read here at every call, so the layer's re-run in backward, which transformers'
# checkpoint makes without our layer wrapper, tiles as the forward did. A plain attribute: not in the state dict.
MLP_TILES = "_selective_ckpt_mlp_tiles"


def mlp_tiles(module):
    """The number of sequence tiles `module` (a converted MLP) runs in: 1 unless its layer's policy says more."""
    return getattr(module, MLP_TILES, 1)


def _gate_up_mlp(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    act = self.act_fn if "act_fn" in self._modules else self.activation_fn  # Llama 4 names it activation_fn
    return self.down_proj(activate(act, gate, up))


def gate_up_mlp_forward(self, x):
    """An MLP of the "gate_up" layout (LlamaMLP's): down(act_fn(gate(x)) * up(x)), projections as modules."""
    pipeline.tag(x, "residual", if_untagged=True)  # x1 where no norm precedes the MLP (post-norm layers)
    return tiling.run_in_tiles(functools.partial(_gate_up_mlp, self), x, mlp_tiles(self))


def _packed_gate_up(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(activate(self.activation_fn, gate, up))


def packed_gate_up_mlp_forward(self, x):
    """Phi3MLP: gate and up are the two halves of the one gate_up_proj output (as transformers chunks it);
    the product act(gate) * up (transformers' up * act(gate), the same bits) is rebuilt from them, so
    the packed output is all the MLP keeps before down_proj."""
    pipeline.tag(x, "residual", if_untagged=True)
    return tiling.run_in_tiles(functools.partial(_packed_gate_up, self), x, mlp_tiles(self))


# --- Dropout by seed: 8 bytes kept instead of a mask.

def dropout_forward(self, x):
    """nn.Dropout by the elementwise stream of the dropout contract; the output is rebuilt in backward
    from the (itself possibly rebuilt) input and the seed, so a consumer that saves it keeps neither."""
    if not self.training or self.p == 0:
        return x
    if self.p == 1:
        return torch.zeros_like(x)
    if self.inplace:
        raise ValueError("in-place dropout cannot be converted; set inplace=False")
    return dropout_by_seed(x, self.p, True)


def dropout_by_seed(x, p, training):
    """nn.functional.dropout(x, p, training) by the dropout contract's elementwise stream: 8 bytes of seed kept,
    the output rebuilt in backward (dropout_forward's rule for a functional dropout, e.g. Starcoder2's)."""
    if not training or p == 0:
        return x
    if p == 1:
        return torch.zeros_like(x)
    p, seed = float(p), rng.draw_seed_tensor(x.device)
    return pipeline.discardable(dropout_op(x, p, seed), dropout_op, pipeline.source(x), p, seed)


def fc_mlp_forward_factory(fc_in="c_fc", act="act", fc_out="c_proj", dropout="dropout"):
    """The forward of a plain MLP dropout(fc_out(act(fc_in(x)))) with these child names (GPT2MLP's by
    default; dropout None for none), its activation applied by `activate`."""
    def forward(self, hidden_states):
        pipeline.tag(hidden_states, "residual", if_untagged=True)

        def mlp(rows):
            return getattr(self, fc_out)(activate(getattr(self, act), getattr(self, fc_in)(rows)))

        out = tiling.run_in_tiles(mlp, hidden_states, mlp_tiles(self))
        # dropout on the whole output, outside the tiles: one seed and the untiled mask whatever the tile count
        return out if dropout is None else getattr(self, dropout)(out)
    return forward


# The code of each MLP forward that tiles (a factory's closures share their code, also once unpickled); the
# mixture-of-experts blocks' forwards (models/moe.py) add theirs through `tiled_forward`.
_TILED_CODES = {f.__code__ for f in (gate_up_mlp_forward, packed_gate_up_mlp_forward, fc_mlp_forward_factory())}


def tiled_forward(forward):
    """Marks `forward`, an MLP's patched forward defined elsewhere, as running in its module's MLP_TILES tiles
    (runs_in_tiles); returns it (a decorator)."""
    _TILED_CODES.add(forward.__code__)
    return forward


def runs_in_tiles(forward):
    """Whether `forward`, an MLP's patched forward (a function or its BoundForward), runs in the sequence tiles its
    module's MLP_TILES asks for."""
    return getattr(getattr(forward, "__func__", forward), "__code__", None) in _TILED_CODES
