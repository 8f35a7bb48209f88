"""selective_ckpt: selective activation recomputation in fused kernels.

Attention keeps q, k, v, o and the row logsumexp; the MLP keeps its fc1 output; softmax, dropout
masks, GELU and LayerNorm outputs are recomputed inside the backward kernels.
"""

from . import rng
from .attention import attention
from .mlp import gelu_mlp
from .ops import dropout

__all__ = ["attention", "dropout", "gelu_mlp", "rng"]
__version__ = "0.1.0"
