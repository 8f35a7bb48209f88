"""selective_ckpt: selective activation recomputation in fused kernels.

Attention keeps q, k, v, o and the row logsumexp; the MLP keeps its fc1 output; softmax, dropout
masks, GELU and LayerNorm outputs are recomputed inside the backward kernels.
"""

from . import keeping, memory, rng
from .backend import set_attention_backend
from .fit import plan
from .layers import SelectiveDecoderLayer, set_policy, set_recompute
from .models import ConversionError, convert
from .ops.attention import attention
from .ops.cross_entropy import linear_cross_entropy
from .ops.dropout import dropout
from .ops.gated_mlp import swiglu_mlp
from .ops.gelu_mlp import gelu_mlp
from .ops.layer_norm import layer_norm
from .ops.rms_norm import rms_norm
from .registry import recomputable_layers

__all__ = ["ConversionError", "SelectiveDecoderLayer", "attention", "convert", "dropout", "gelu_mlp", "keeping",
           "layer_norm", "linear_cross_entropy", "memory", "plan", "recomputable_layers", "rms_norm", "rng",
           "set_attention_backend", "set_policy", "set_recompute", "swiglu_mlp"]
__version__ = "0.1.0"
