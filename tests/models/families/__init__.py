"""The Hugging Face families convert() supports, as tiny configurations the shared tests run.

Each module of this package defines `FAMILIES`, a list of `Family`; tests/models/test_hf_families.py
runs every check on every family collected here, so a new family is a few lines in one module.
"""

import dataclasses
import importlib
import pkgutil


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # config.model_type
    config: object  # transformers config class
    causal_lm: object  # the causal-LM class
    tiny: dict  # config keyword arguments of the tiny model (hidden 64, 2 layers)
    lora_targets: tuple = ("q_proj", "v_proj", "down_proj")
    packed: bool = True  # documents packed by position_ids stay apart (the family's attention allows it)
    heads: tuple = ()  # other model classes of the family whose layers convert (sequence/token classification)
    # a sliding window (in tokens) the tiny config sets in every layer, shorter than the test sequence: with one
    # layer, the first token reaches no position `window` or more behind it (test_window_is_applied)
    window: int = 0
    # config keyword arguments that switch the family's dropouts on: "none", "selective", "full" and
    # gradient_checkpointing_enable give the same bits with them (test_modes_bit_identical_with_dropout)
    dropout: dict | None = None
    # (name, config keyword arguments): other forms of the family's layers, each within the rule against
    # float64 with padded rows (test_variant_within_the_rule)
    variants: tuple = ()
    # {check: reason}: shared checks outside tests/models/test_hf_families.py this family cannot run ("fit":
    # tests/fit/test_fit.py), each skipped with its reason (skips)
    skip: dict | None = None
    # (name, config keyword arguments) of each kind of layer a hybrid family mixes (full- and linear-attention
    # layers): test_layer_keeps_its_estimate measures a layer of each kind, in a model of that kind alone
    layer_kinds: tuple = ()
    # the 20-step training run amplifies rounding past 1e-4 relative (a router logit one ulp apart sends a token to
    # another expert): its loss curve is held to 3x the gap between transformers' own eager and SDPA runs of it
    # instead (test_training_follows_the_unconverted_losses)
    amplifies_rounding: bool = False

    def skips(self, check):
        """pytest marks for `check`: a skip with the family's reason, or none."""
        import pytest

        reason = (self.skip or {}).get(check)
        return [pytest.mark.skip(reason=f"{self.name}: {reason}")] if reason else []

    def build(self, **kw):
        """A zero-argument builder of the causal LM with the tiny config updated by `kw`."""
        return lambda: self.causal_lm(self.config(**{**self.tiny, **kw}))

    def __str__(self):
        return self.name


def collect():
    families = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        families += importlib.import_module(f"{__name__}.{info.name}").FAMILIES
    return families


def by_name(name):
    """The family whose model type is `name`."""
    return next(f for f in collect() if f.name == name)
