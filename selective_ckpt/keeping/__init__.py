"""What a forward keeps for backward, decided in one place: per layer and per class of tensor, keep it on the
device, offload it to host memory, or rebuild it (policy); the one pack/unpack pipeline per layer that applies
the policy (pipeline); the attention-kept checkpoint (attention_kept); the MLP in sequence tiles (tiling); the
offload engine that copies to host and back (offload, streams).
"""

from .offload import OffloadEngine
from .pipeline import active, autocast_on, discardable, observe, scope, source, tag
from .policy import ACTIONS, CLASSES, NAMED, LayerPolicy, policy, resolve, split_parts
from .tiling import run_in_tiles

__all__ = ["ACTIONS", "CLASSES", "NAMED", "LayerPolicy", "OffloadEngine", "active", "autocast_on", "discardable",
           "observe", "policy", "resolve", "run_in_tiles", "scope", "source", "split_parts", "tag"]
