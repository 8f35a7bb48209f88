"""Hugging Face Mixtral: Llama-shaped attention and norms; every layer's MLP a sparse mixture of experts
(models/moe.py), its experts keeping each routed row's gate and up outputs; the router is transformers'."""

import torch

from .moe import MoESpec, refuse_jitter
from .spec import llama_shaped

SPEC = llama_shaped("mixtral", "Mixtral",
                    moe=MoESpec("MixtralSparseMoeBlock", ("gate", "experts"), "MixtralExperts", "MixtralTopKRouter",
                                check=refuse_jitter, weights_dtype=torch.float32))
