"""Will it fit: the memory of one whole training step (weights, gradients, optimizer state, activations,
the loss head, transients), for transformers' model as it trains by default, with activation checkpointing,
and converted in each recompute mode, from a config alone (`python -m selective_ckpt.fit`). Needs the [hf]
extra (transformers, peft); without it, MissingExtra (an ImportError) names the line that installs it."""

from .arithmetic import VARIANTS, BudgetError, Fit, fit, predict
from .configs import BUNDLED, HF_EXTRA, MissingExtra, load_config
from .forms import TrainingForm

__all__ = ["BUNDLED", "HF_EXTRA", "VARIANTS", "BudgetError", "Fit", "MissingExtra", "TrainingForm", "fit",
           "load_config", "predict"]
