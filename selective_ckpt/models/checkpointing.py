"""Layer checkpointing the user enabled before convert() stays enabled after it.

transformers' `gradient_checkpointing_enable()` / `activation_checkpointing_enable(every_n_layers=k)`
(and peft's `prepare_model_for_kbit_training(use_gradient_checkpointing=True)`, which calls it) set
`gradient_checkpointing` and `_gradient_checkpointing_func` on the decoder layers. A converted layer
reads that flag as recompute "full"; giving it its initial mode would clear the flag, so the layers
that had it are set back to "full" after convert, with the checkpoint function the user chose
(reentrant or not, offloaded or not) left in place.
"""

from .common import STATE


def checkpointed(layers):
    """The decoder layers among `layers` that run transformers' checkpointing now (before convert)."""
    return [layer for layer in layers if getattr(layer, "gradient_checkpointing", False)]


def keep_checkpointed(layers):
    """After convert: each of `layers` (from `checkpointed`) recomputes "full" again, as before."""
    for layer in layers:
        state = getattr(layer, STATE)
        state.recompute = "full"
        state.full_asked = False  # transformers' checkpointing, as one switched on after convert: warned of
