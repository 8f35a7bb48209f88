"""Configs the fit tool reads: a config.json path, or a bundled config built from published sizes."""

import importlib.util
import json
import os
import sys
from importlib import resources

from .. import compat

HF_EXTRA = 'pip install "selective_ckpt[hf]"'


class MissingExtra(ImportError):
    """A package the fit needs is not installed; the message names it and the extra that installs it."""


def require(*packages, what="selective_ckpt.fit"):
    """Raises MissingExtra naming the first of `packages` that is not installed and the line that installs it."""
    for name in packages:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtra(f"{what} needs {name}, which is not installed: {HF_EXTRA}")


def exit_code(main, prog):
    """Runs a command-line `main()` for its exit code; a missing extra is one line naming the line that installs it
    (exit 1), not a traceback."""
    try:
        return main()
    except MissingExtra as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1

# Published sizes (each model's config.json on its model card), as package data in bundled/: only what
# the memory model reads.
BUNDLED = {
    "Llama-3.1-8B": "llama-3.1-8b.json",
    "Qwen3-8B": "qwen3-8b.json",
    "Mistral-7B": "mistral-7b.json",
    "Gemma-2-9B": "gemma-2-9b.json",
    "Mixtral-8x7B": "mixtral-8x7b.json",
    # hybrids: three linear-attention (Gated DeltaNet) layers to each full-attention one; Qwen3.5-9B's text model
    "Qwen3-Next-80B-A3B": "qwen3-next-80b-a3b.json",
    "Qwen3.5-9B": "qwen3.5-9b.json",
    # a mixture of experts with attention sinks and alternating sliding-window layers; its experts are 3-D
    # parameters, which bitsandbytes' 4-bit layers do not quantize (a QLoRA base keeps them unquantized)
    "gpt-oss-20b": "gpt-oss-20b.json",
    # sliding layers (head dim 256, 16 kv heads) and every sixth a full one with its own head dim (512) and kv heads
    # (4, v from k_proj): a per-layer config
    "Gemma-4-31B": "gemma-4-31b.json",
}


def bundled(name):
    """The dict of a bundled config (BUNDLED's names), read from the package data."""
    return json.loads(resources.files(__package__).joinpath("bundled", BUNDLED[name]).read_text())


REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def load_config(config):
    """A transformers config from a bundled name, a config.json path, a dict or a config object.

    Raises ValueError naming the field when a size the memory model reads is missing or not positive,
    or the model type is unknown to transformers; MissingExtra (an ImportError) when transformers is not installed.
    """
    require("transformers")
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        d = config.to_dict()
    elif isinstance(config, dict):
        d = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        if str(config) in BUNDLED:
            d = bundled(str(config))
        elif os.path.isfile(config):
            with open(config) as f:
                d = json.load(f)
        else:
            raise ValueError(f"config {str(config)!r} is neither a config.json file nor a bundled config "
                             f"({', '.join(BUNDLED)})")
    else:
        raise TypeError(f"config must be a path, a bundled name, a dict or a PretrainedConfig, got "
                        f"{type(config).__name__}")
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ValueError("config: field 'model_type' is missing")
    if isinstance(d.get("text_config"), (dict, PretrainedConfig)) and any(f not in d for f in REQUIRED):
        raise ValueError(f"config: a {model_type!r} config holds its text model's sizes in its text_config: the fit "
                         "projects a causal LM; pass config.text_config (a vision tower's weights are left out)")
    for field in REQUIRED:
        v = d.get(field, {"hidden_size": d.get("n_embd"), "num_hidden_layers": d.get("n_layer"),
                          "num_attention_heads": d.get("n_head")}.get(field))
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"config: field {field!r} must be a positive integer (a size the memory model reads), "
                             f"got {v!r}")
    try:
        out = AutoConfig.for_model(model_type, **d)
    except ValueError as err:
        raise ValueError(f"config: field 'model_type' {model_type!r} is not a transformers model type "
                         f"({err})") from None
    if isinstance(config, PretrainedConfig):  # the implementations set on it, which to_dict leaves out
        compat.set_requested_attention_implementation(out, compat.requested_attention_implementation(config))
        compat.set_requested_experts_implementation(out, compat.requested_experts_implementation(config))
    return out
