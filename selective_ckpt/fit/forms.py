"""The training form: what is trained and in which precision."""

import dataclasses

import torch

from ..memory.units import as_dtype
from ..validation import check_positive_int

KINDS = ("full", "lora", "qlora")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class TrainingForm:
    """kind: "full" (every weight trained by AdamW), "lora" (rank `rank` adapters on `targets`, the base
    frozen) or "qlora" (LoRA over bitsandbytes 4-bit NF4 bases, after prepare_model_for_kbit_training).
    `weights`: the dtype of the weights (and of AdamW's state for trained ones); `autocast`: the dtype
    autocast computes in (None: no autocast); `lora_dropout`: PEFT's dropout on the adapters' input."""

    kind: str = "full"
    weights: torch.dtype = torch.float32
    autocast: torch.dtype = None
    rank: int = 16
    targets: tuple = ALL_LINEAR
    lora_dropout: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "weights", as_dtype(self.weights, "weights"))
        if self.autocast is not None:
            object.__setattr__(self, "autocast", as_dtype(self.autocast, "autocast"))
        check_positive_int(self.rank, "rank")
        if isinstance(self.targets, str) or not self.targets:
            raise ValueError(f"targets must be a non-empty tuple of module names, got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, (int, float)) or \
                not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be a number in [0, 1), got {self.lora_dropout!r}")
        if self.kind == "qlora" and self.weights != torch.float32:
            raise ValueError("weights: QLoRA keeps every non-quantized weight in float32 "
                             "(prepare_model_for_kbit_training); pass weights=float32")

    @property
    def compute(self):
        return self.autocast if self.autocast is not None and self.weights == torch.float32 else self.weights

    def __str__(self):
        prec = str(self.weights).replace("torch.", "") + (
            f", {str(self.autocast).replace('torch.', '')} autocast" if self.autocast is not None else "")
        if self.kind == "full":
            return f"full fine-tune, AdamW, {prec}"
        drop = f", dropout {self.lora_dropout}" if self.lora_dropout else ""
        return (f"{'QLoRA 4-bit' if self.kind == 'qlora' else 'LoRA'} r={self.rank}{drop} on {','.join(self.targets)}, "
                f"{prec}")
