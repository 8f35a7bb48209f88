"""Configs the fit tool reads: a config.json path, or a bundled config built from published sizes."""

import json
import os

# Published sizes (each model's config.json on its model card); only what the memory model reads.
BUNDLED = {
    "Llama-3.1-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False),
    "Qwen3-8B": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    "Mistral-7B": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False),
    "Gemma-2-9B": dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
                       final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True),
    "Mixtral-8x7B": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}

REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def load_config(config):
    """A transformers config from a bundled name, a config.json path, a dict or a config object.

    Raises ValueError naming the field when a size the memory model reads is missing or not positive,
    or the model type is unknown to transformers.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        d = config.to_dict()
    elif isinstance(config, dict):
        d = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        if str(config) in BUNDLED:
            d = dict(BUNDLED[str(config)])
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
    for field in REQUIRED:
        v = d.get(field, {"hidden_size": d.get("n_embd"), "num_hidden_layers": d.get("n_layer"),
                          "num_attention_heads": d.get("n_head")}.get(field))
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"config: field {field!r} must be a positive integer (a size the memory model reads), "
                             f"got {v!r}")
    try:
        return AutoConfig.for_model(model_type, **d)
    except ValueError as err:
        raise ValueError(f"config: field 'model_type' {model_type!r} is not a transformers model type "
                         f"({err})") from None
