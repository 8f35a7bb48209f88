"""In-place forward patches for Hugging Face norms, MLP activations and dropouts.

Modules, parameters and names stay; only `forward` of the instance is replaced. Each patched
forward keeps what its own backward needs (a norm: its input and statistics; an activation: its
input(s)) and hands its output to `recompute.discardable`, so whatever consumes the output (a
Linear, a LoRA layer, a quantized Linear) keeps a placeholder instead, rebuilt once in backward.
"""

import types

import torch

from .. import recompute, rng
from ..ops.dropout import dropout_op
from ..ops.gelu import gelu_backward_op, gelu_op
from ..ops.layer_norm import layer_norm_apply, layer_norm_fwd

PATCHED = "_selective_ckpt_forward"  # attribute marking a patched module (holds the original forward)


def patch_forward(module, forward):
    """Replaces module.forward by `forward` bound to module; the original is kept under PATCHED."""
    if getattr(module, PATCHED, None) is None:
        setattr(module, PATCHED, module.forward)
    module.forward = types.MethodType(forward, module)


# --- LayerNorm (GPT-2): the fused kernel keeps x, mean, rstd; the output is rebuilt from them.

def layer_norm_forward(self, x):
    w = self.weight.to(x.dtype)
    b = None if self.bias is None else self.bias.to(x.dtype)
    y, mean, rstd = layer_norm_fwd(x, w, b, float(self.eps))
    return recompute.discardable(y, layer_norm_apply, x, w, b, mean, rstd)


# --- RMSNorm (Llama, Mistral, Qwen2, Qwen3 incl. q/k norms): Hugging Face's formula, keeping x and rstd.

def _rms_apply(x, weight, rstd):
    """weight * (x32 * rstd).to(x.dtype), as LlamaRMSNorm computes it (the same bits)."""
    return weight * (x.to(torch.float32) * rstd).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """y = weight * (x32 * rstd).to(x.dtype) with rstd computed outside; backward keeps x and rstd."""

    @staticmethod
    def forward(ctx, x, weight, rstd):
        ctx.save_for_backward(x, weight, rstd)
        return _rms_apply(x, weight, rstd)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dweight = dx = None
        if ctx.needs_input_grad[1]:
            n = (x.to(torch.float32) * rstd).to(x.dtype)
            dweight = (dy * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            dn = (dy * weight).to(torch.float32)
            x32 = x.to(torch.float32)
            dx = (rstd * (dn - x32 * (rstd * rstd) * (dn * x32).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dweight, None


def rms_norm(x, weight, eps):
    """Hugging Face's RMSNorm output; keeps x and the fp32 rstd, the output goes to recompute."""
    with torch.no_grad():
        rstd = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    y = _RMSNorm.apply(x, weight, rstd)
    return recompute.discardable(y, _rms_apply, x, weight, rstd)


def rms_norm_forward(self, x):
    eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
    return rms_norm(x, self.weight, float(eps))


# --- Activations: GELU (GPT-2) through the kernels, keeping its input.

class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, approximate):
        ctx.approximate = approximate
        ctx.save_for_backward(h)
        return gelu_op(h, approximate)

    @staticmethod
    def backward(ctx, da):
        (h,) = ctx.saved_tensors
        dh = da.contiguous().clone()
        gelu_backward_op(dh, h, ctx.approximate)
        return dh, None


def gelu(h, approximate):
    a = _GELU.apply(h, approximate)
    return recompute.discardable(a, gelu_op, h.contiguous(), approximate)


# --- SwiGLU (Llama family): act(gate) * up, keeping gate and up.

class _GatedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act):
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            g = gate.detach().requires_grad_(True)
            a = ctx.act(g)
            dgate = torch.autograd.grad(a, g, dh * up)[0] if ctx.needs_input_grad[0] else None
        dup = dh * a.detach() if ctx.needs_input_grad[1] else None
        return dgate, dup, None


def gated_product(gate, up, act):
    h = _GatedProduct.apply(gate, up, act)
    return recompute.discardable(h, lambda g, u: act(g) * u, gate, up)


def swiglu_mlp_forward(self, x):
    """LlamaMLP / MistralMLP / Qwen2MLP / Qwen3MLP: down(act(gate(x)) * up(x)), projections as modules."""
    return self.down_proj(gated_product(self.gate_proj(x), self.up_proj(x), self.act_fn))


# --- Dropout by seed: 8 bytes kept instead of a mask.

def dropout_forward(self, x):
    if not self.training or self.p == 0:
        return x
    if self.p == 1:
        return torch.zeros_like(x)
    if self.inplace:
        raise ValueError("in-place dropout cannot be converted; set inplace=False")
    return dropout_op(x, float(self.p), rng.draw_seed_tensor(x.device))


def gelu_mlp_forward_factory(approximate):
    def forward(self, hidden_states):
        h = self.c_fc(hidden_states)
        return self.dropout(self.c_proj(gelu(h, approximate)))
    return forward
