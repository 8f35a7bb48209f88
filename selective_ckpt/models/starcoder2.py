"""Hugging Face Starcoder2: LayerNorm with bias and the c_fc -> GELU -> c_proj MLP patched in place, attention
through the registry (grouped k/v, config.sliding_window), and its functional dropouts by seed.

Starcoder2 drops out with `nn.functional.dropout` rather than modules: after the attention's o_proj
(`residual_dropout`), after the MLP's c_proj (the same rate) and on the embeddings (`embedding_dropout`).
Each runs here by the dropout contract's elementwise stream (8 bytes of seed instead of a mask): the
MLP's forward is ours, and the attention's and the model's own forwards run with their rate set to 0
for that call while the same dropout is applied by seed to what they would have dropped out (the
attention's output; the embeddings, which the model's forward then receives as inputs_embeds).
"""

import inspect

from torch import nn

from .checks import modules_of
from .layer_shape import config_shape
from .patches import activate, dropout_by_seed
from .patching import PATCHED
from .spec import MLPSpec, ModelSpec, NormSpec


def _mlp_forward(self, hidden_states):
    out = self.c_proj(activate(self.act, self.c_fc(hidden_states)))
    return dropout_by_seed(out, self.residual_dropout, self.training)


def _without_rate(module, attribute, call):
    """call() with module.<attribute> (a dropout rate) set to 0 for its duration."""
    p = getattr(module, attribute)
    setattr(module, attribute, 0.0)
    try:
        return call()
    finally:
        setattr(module, attribute, p)


def _attention_forward(self, *args, **kwargs):
    original = getattr(self, PATCHED)
    if not self.training or not self.residual_dropout:
        return original(*args, **kwargs)
    out, weights = _without_rate(self, "residual_dropout", lambda: original(*args, **kwargs))
    return dropout_by_seed(out, self.residual_dropout, True), weights


def _model_forward(self, *args, **kwargs):
    original = getattr(self, PATCHED)
    if not self.training or not self.embedding_dropout:
        return original(*args, **kwargs)
    names = list(inspect.signature(inspect.unwrap(type(self).forward)).parameters)[1:]  # the forward's own order
    args, kwargs = list(args), dict(kwargs)

    def get(name):
        i = names.index(name)
        return args[i] if i < len(args) else kwargs.get(name)

    def put(name, value):
        i = names.index(name)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value

    ids, embeds = get("input_ids"), get("inputs_embeds")
    if (ids is None) == (embeds is None):
        return original(*args, **kwargs)  # the model's own forward reports the bad call
    if embeds is None:
        embeds = self.embed_tokens(ids)
    put("input_ids", None)
    put("inputs_embeds", dropout_by_seed(embeds, self.embedding_dropout, True))
    return _without_rate(self, "embedding_dropout", lambda: original(*args, **kwargs))


def _patches(root):
    return ([(m, _attention_forward) for _, m in modules_of(root, "Starcoder2Attention")]
            + [(m, _model_forward) for _, m in modules_of(root, "Starcoder2Model")])


def _shape(layer, config, spec):
    """config_shape with config.sliding_window, which every layer's attention applies."""
    return {**config_shape(layer, config, spec), "sliding_window": getattr(config, "sliding_window", None) or None}


SPEC = ModelSpec(
    model_types=("starcoder2",), layer="Starcoder2DecoderLayer",
    children=(("input_layernorm", "norm"), ("self_attn", "attention"), ("post_attention_layernorm", "norm"),
              ("mlp", "mlp")),
    norm=NormSpec("layernorm", nn.LayerNorm), attention="Starcoder2Attention",
    attention_children=("q_proj", "k_proj", "v_proj", "o_proj"),
    mlp=MLPSpec("Starcoder2MLP", "fc", ("c_fc", "act", "c_proj"), forward=_mlp_forward),
    patches=_patches, shape=_shape)
