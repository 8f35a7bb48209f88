"""Will it fit: the memory of one whole training step (weights, gradients, optimizer state, activations,
the loss head, transients), for transformers' model as it trains by default, with activation checkpointing,
and converted in each recompute mode, from a config alone (`python -m selective_ckpt.fit`). Needs the [hf]
extra (transformers, peft); without it, MissingExtra (an ImportError) names the line that installs it."""

from .arithmetic import VARIANTS, BudgetError
from .configs import BUNDLED, HF_EXTRA, MissingExtra, load_config
from .fitting import Fit, fit, form_of, plan, predict
from .forms import TrainingForm
from .planner import Plan, PlanError
from .rates import RATES, Rates, probe, rates_for

__all__ = ["BUNDLED", "HF_EXTRA", "RATES", "VARIANTS", "BudgetError", "Fit", "MissingExtra", "Plan", "PlanError",
           "Rates", "TrainingForm", "fit", "form_of", "load_config", "plan", "predict", "probe", "rates_for"]
