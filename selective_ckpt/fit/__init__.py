"""Will it fit: the memory of one whole training step (weights, gradients, optimizer state, activations,
the loss head, transients), for transformers' model as it trains by default, with gradient checkpointing,
and converted in each recompute mode, from a config alone (`python -m selective_ckpt.fit`)."""

from .arithmetic import VARIANTS, Fit, fit, predict
from .configs import BUNDLED, load_config
from .forms import TrainingForm

__all__ = ["BUNDLED", "VARIANTS", "Fit", "TrainingForm", "fit", "load_config", "predict"]
