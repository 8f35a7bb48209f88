"""selective_ckpt: selective activation recomputation in fused kernels.

Attention keeps q, k, v, o and the row logsumexp; the MLP keeps its fc1 output; softmax, dropout
masks, GELU and LayerNorm outputs are recomputed inside the backward kernels.
"""

from . import memory, rng
from .attention import attention
from .convert import convert
from .layers import SelectiveAttention, SelectiveDecoderLayer, SelectiveMLP, set_recompute
from .mlp import gelu_mlp
from .ops import dropout

__all__ = ["SelectiveAttention", "SelectiveDecoderLayer", "SelectiveMLP", "attention", "convert", "dropout", "gelu_mlp",
           "memory", "rng", "set_recompute"]
__version__ = "0.1.0"
