"""In-place forward patches for Hugging Face norms, MLP activations and dropouts.

Modules, parameters and names stay; only `forward` of the instance is replaced. Each patched
forward keeps what its own backward needs (a norm: its input and statistics; an activation: its
input(s)) and hands its output to `recompute.discardable`, so whatever consumes the output (a
Linear, a LoRA layer, a quantized Linear) keeps a placeholder instead, rebuilt once in backward.
"""

import torch

from .. import recompute, rng
from ..ops.dropout import dropout_op
from ..ops.gelu import gelu_backward_op, gelu_op
from ..ops.layer_norm import layer_norm_apply, layer_norm_fwd
from ..ops.rms_norm import rms_norm_apply, rms_norm_fwd
from ..ops.swiglu import gated_product, gated_product_op

PATCHED = "_selective_ckpt_forward"  # attribute marking a patched module (holds the original forward)


def patch_forward(module, forward):
    """Replaces module.forward by `forward` bound to module (a BoundForward, which pickles); the original is
    kept under PATCHED."""
    from .pickling import BoundForward

    if getattr(module, PATCHED, None) is None:
        setattr(module, PATCHED, module.forward)
    module.forward = BoundForward(forward, module)


# --- LayerNorm (GPT-2): the fused kernel keeps x, mean, rstd; the output is rebuilt from them.

def layer_norm_forward(self, x):
    w = self.weight.to(x.dtype)
    b = None if self.bias is None else self.bias.to(x.dtype)
    y, mean, rstd = layer_norm_fwd(x, w, b, float(self.eps))
    return recompute.discardable(y, layer_norm_apply, x, w, b, mean, rstd)


# --- RMSNorm (Llama, Mistral, Qwen2, Qwen3 incl. q/k norms): the fused kernel in Hugging Face's rounding
# order, weight * (x32 * rstd).to(x.dtype); keeps x and the fp32 rstd, the output is rebuilt from them.

def rms_norm_forward(self, x):
    if self.weight.dtype != x.dtype:
        # transformers then returns weight's promoted dtype, which the kernel (weight in x's dtype)
        # would not reproduce: compute as transformers does, keeping what it keeps.
        return getattr(self, PATCHED)(x)
    eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
    y, rstd = rms_norm_fwd(x, self.weight, float(eps), 0.0)
    return recompute.discardable(y, rms_norm_apply, x, self.weight, rstd, 0.0)


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


# --- SwiGLU (Llama family): silu(gate) * up by the fused kernel, keeping gate and up.

def swiglu_mlp_forward(self, x):
    """LlamaMLP / MistralMLP / Qwen2MLP / Qwen3MLP: down(silu(gate(x)) * up(x)), projections as modules."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    h = gated_product(gate, up, "silu")
    return self.down_proj(recompute.discardable(h, gated_product_op, gate, up, "silu"))


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
