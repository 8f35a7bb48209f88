"""Activation memory: what a forward keeps for backward (ledger), what it should keep (estimate),
how high a step peaks (peak), and which recompute mode each layer can afford under a budget (plan).
"""

from ..validation import RECOMPUTE_MODES as MODES
from .estimate import LoRA, Mixer, MoE, estimate, forward_flops, recompute_flops
from .latent_attention import MLA
from .ledger import LedgerReport, SavedEntry, graph_saved_bytes, ledger, note_saved, sac_context_fn
from .parts import Attention, DenseMLP, Residual, Scalars
from .peak import StorageTracker, cpu_allocation_deltas, cpu_peak_bytes, running_peak
from .planner import LayerShape, Plan, plan
from .units import as_dtype, format_bytes

__all__ = ["MODES", "Attention", "DenseMLP", "LoRA", "MLA", "Mixer", "MoE", "LayerShape", "LedgerReport", "Plan",
           "Residual", "SavedEntry", "Scalars", "StorageTracker", "as_dtype", "cpu_allocation_deltas", "cpu_peak_bytes",
           "estimate", "format_bytes", "forward_flops", "graph_saved_bytes", "ledger", "note_saved", "plan",
           "recompute_flops", "running_peak", "sac_context_fn"]
