"""A model's StepCost (fit.timing) from its config and training form, read off a one-layer model on the meta
device: every weight of two or more dimensions in a decoder layer is met by each token once (a matmul, as nn.Linear,
GPT-2's Conv1D or a router's weight), an experts tensor of three dimensions by top_k of its experts."""

import torch
from torch import nn

from .. import compat
from .timing import MLP_CHILDREN, StepCost


def _top_k(config):
    k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None) or 1
    return k[0] if isinstance(k, (list, tuple)) else k


def _spans(config):
    L = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in list(types)[:L])
    if window is not None and getattr(config, "use_sliding_window", True):
        return (window,) * L
    return (None,) * L


def step_cost(config, form):
    """StepCost of transformers' causal LM of `config` trained in `form` (fit.TrainingForm)."""
    from transformers import AutoModelForCausalLM

    from .simulate import decoder_layers

    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:1]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=form.weights)
    layer = decoder_layers(model)[0]
    top_k = _top_k(config)
    weights = mlp = lora = lora_io = 0
    targets = set(form.targets) if form.kind != "full" else set()
    for name, p in layer.named_parameters():
        if p.dim() < 2:
            continue
        n = p.numel() * top_k // p.shape[0] if p.dim() == 3 else p.numel()
        weights += n
        if name.split(".")[0] in MLP_CHILDREN:
            mlp += n
    for name, m in layer.named_modules():
        if name.rsplit(".", 1)[-1] in targets and isinstance(m, nn.Linear):
            lora += form.rank * (m.in_features + m.out_features)
            # PEFT reads the input, writes B's output, scales it and adds it to the base's: in + 5 out elements
            lora_io += m.in_features + 5 * m.out_features
    head = model.get_output_embeddings()
    head_weights = head.weight.numel()
    hidden = config.hidden_size
    heads = config.num_attention_heads
    # a per-layer config (Gemma 4's full layers with their own head dim) has no global head_dim: the first layer's
    head_dim = (compat.global_config_value(config, "head_dim")
                or next((m.head_dim for m in layer.modules() if isinstance(getattr(m, "head_dim", None), int)), None)
                or hidden // heads)
    ffn = mlp // (3 * hidden) if mlp else 4 * hidden  # gated: three matmuls of h x f a token
    # attention's weights but the out-projection's (heads x head_dim -> hidden): q, k and v
    qkv = max(weights - mlp - heads * head_dim * hidden, 0)
    L = config.num_hidden_layers
    quantized = weights if form.kind == "qlora" else 0
    if form.kind == "full":
        emb = model.get_input_embeddings().weight.numel()
        tied = getattr(config, "tie_word_embeddings", False)
        trained = L * sum(p.numel() for p in layer.parameters()) + emb + (0 if tied else head_weights)
    else:
        trained = L * lora
    elem = torch.empty((), dtype=form.compute).element_size()
    # autocast casts each fp32 base weight to the compute dtype at every pass (4 bytes read, elem written)
    cast = weights * (4 + elem) if form.autocast is not None and form.weights == torch.float32 and not quantized else 0
    return StepCost(hidden=hidden, ffn=ffn, heads=heads, head_dim=head_dim, spans=_spans(config),
                    layer_weights=weights, mlp_weights=mlp, qkv_weights=qkv, lora_weights=lora, lora_io=lora_io,
                    cast_bytes=cast, head_weights=head_weights,
                    trained_base=form.kind == "full", quantized_weights=quantized, trained_weights=trained,
                    dtype=form.compute, elem=elem)
