"""Hugging Face Falcon-H1 (FalconH1ForCausalLM): every decoder layer runs a Mamba-2 mixer (`mamba`) and attention
(`self_attn`) in parallel on the same normed input, x1 = x + ssm_out * mamba(n) + attn_out * attn(attn_in * n),
then y = x1 + mlp(norm(x1)), with scalar multipliers (the key's, the MLP's gate and down, the embedding's and
the logits'; the Mamba-2 mixer's input and its MuP vector). The attention converts at the floor (our kernels
through transformers' attention registry, transformers' forward), the norms and the MLP convert (the gate's
multiplier applied to gate_proj's output, which the activation keeps in place of it); the Mamba-2 mixer keeps
transformers' implementation and what it saves (spec.MixerSpec, beside the attention; said once at convert)."""

import functools

from ..keeping import pipeline, tiling
from .checks import modules_of
from .errors import ConversionError
from .patches import activate, mlp_tiles
from .spec import GATE_UP_CHILDREN, MixerSpec, MLPSpec, NormSpec, llama_shaped

MAMBA_WHY = ("its Mamba-2 scan (short convolution, chunked state-space recurrence, gated RMSNorm) has no kernel "
             "here; its forward and what it saves for backward are transformers'")

# products by a Python float outside the mixer, each keeping the float as a 0-dim float64 tensor: the key's
# (attention), the gate's and down_proj's (MLP), the attention input's, attention output's and the mixer output's
SCALARS = 6


def _mlp(self, x):
    gate = self.gate_proj(x) * self.gate_multiplier
    return self.down_proj(activate(self.act_fn, gate, self.up_proj(x))) * self.down_multiplier


def mlp_forward(self, x):
    """FalconH1MLP: down(up * act(gate * m_gate)) * m_down, the activation kept on the scaled gate (the product
    rebuilt), as transformers computes it (act(g) * up, the same bits as up * act(g))."""
    pipeline.tag(x, "residual", if_untagged=True)
    return tiling.run_in_tiles(functools.partial(_mlp, self), x, mlp_tiles(self))


def check(root, name):
    """ConversionError before anything changes when a mixer lacks the MuP vector its forward reads."""
    for n, mixer in modules_of(root, "FalconH1Mixer"):
        if getattr(mixer, "mup_vector", None) is None:
            raise ConversionError(f"{name}: {n} has no mup_vector; it cannot be kept as transformers' own")


SPEC = llama_shaped("falcon_h1", "FalconH1",
                    children=(("input_layernorm", "norm"), ("mamba", "mixer"), ("self_attn", "attention"),
                              ("pre_ff_layernorm", "norm"), ("feed_forward", "mlp")),
                    mlp=MLPSpec("FalconH1MLP", "gate_up", GATE_UP_CHILDREN, mlp_forward),
                    norm=NormSpec("rmsnorm", "FalconH1RMSNorm"), scalar_multipliers=SCALARS, check=check,
                    mixer=MixerSpec("FalconH1Mixer", MAMBA_WHY, beside_attention=True))
