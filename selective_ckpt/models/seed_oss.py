"""Hugging Face Seed-OSS: Llama-shaped (RMSNorm, gated MLP, grouped k/v, q/k/v biases, o_proj bias by
config.attention_out_bias, MLP biases by config.mlp_bias), with functional residual dropouts after o_proj and
after down_proj (config.residual_dropout) beside the attention dropout.

Both residual dropouts run by seed (8 bytes kept instead of a mask, the output rebuilt in backward), as
Starcoder2's do: the MLP's forward is ours and drops out its down_proj output; the attention's own forward
runs with its rate at 0 for the call, and the same dropout is applied by seed to its output.
"""

from .checks import modules_of
from .patches import dropout_by_seed, gate_up_mlp_forward
from .patching import PATCHED
from .spec import GATE_UP_CHILDREN, MLPSpec, llama_shaped


def _mlp_forward(self, x):
    """SeedOssMLP: dropout(down(act(gate(x)) * up(x)), residual_dropout), the dropout by seed."""
    return dropout_by_seed(gate_up_mlp_forward(self, x), self.residual_dropout, self.training)


def _attention_forward(self, *args, **kwargs):
    """SeedOssAttention's own forward with residual_dropout at 0 for the call, its output dropped out by seed."""
    original = getattr(self, PATCHED)
    p = self.residual_dropout
    if not self.training or not p:
        return original(*args, **kwargs)
    self.residual_dropout = 0.0
    try:
        out, weights = original(*args, **kwargs)
    finally:
        self.residual_dropout = p
    return dropout_by_seed(out, p, True), weights


def _patches(root):
    return [(m, _attention_forward) for _, m in modules_of(root, "SeedOssAttention")]


SPEC = llama_shaped("seed_oss", "SeedOss", mlp=MLPSpec("SeedOssMLP", "gate_up", GATE_UP_CHILDREN, forward=_mlp_forward),
                    patches=_patches)
