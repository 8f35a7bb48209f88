"""Checks every Hugging Face family test runs: the converted model against float64, unconverted in its dtype."""

import copy

import torch

from selective_ckpt import convert
from selective_ckpt.memory.peak import cpu_allocation_deltas
from tests.reference import assert_within_rule

VOCAB = 97


def triple(build, dtype=torch.float32):
    """(float64 reference, unconverted on SDPA, converted; both in `dtype`) with the same weights. A model
    that soft-caps its attention scores (which SDPA refuses) runs transformers' eager attention unconverted
    and REFERENCE_ATTENTION in float64."""
    torch.manual_seed(0)
    ref = build().double().train()
    ref.config._attn_implementation = reference_attention(ref.config)
    plain = copy.deepcopy(ref).to(dtype)
    plain.config._attn_implementation = unconverted_attention(plain.config)
    ours = convert(copy.deepcopy(plain))
    return ref, plain, ours


REFERENCE_ATTENTION = "float64_reference"


def _capped_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Materialised attention in the inputs' dtype for a float64 reference: soft-capped scores when asked,
    the bool mask SDPA's builder makes (None: causal), softmax in that dtype, rows attending nothing give 0."""
    G = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    s = (query @ k.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    Sq, Sk = s.shape[-2:]
    if attention_mask is None:
        allowed = torch.ones(Sq, Sk, dtype=torch.bool, device=s.device).tril(Sk - Sq)[None, None]
    else:
        allowed = attention_mask.bool()
    anything = allowed.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(anything, s.masked_fill(~allowed, float("-inf")), 0.0), -1) * anything
    return (probs @ v).transpose(1, 2).contiguous(), None


SINK_FAMILIES = ("gpt_oss",)  # attention sinks, which transformers' SDPA attention leaves out


def unconverted_attention(config):
    """The attention an unconverted test model runs: SDPA, or transformers' eager one for soft-capped scores
    (which SDPA refuses) and attention sinks (which SDPA leaves out)."""
    if getattr(config, "attn_logit_softcapping", None) is not None or config.model_type in SINK_FAMILIES:
        return "eager"
    return "sdpa"


def reference_attention(config):
    """The attention of a float64 reference: SDPA's math path, _capped_reference for soft-capped scores
    (transformers' eager masks give NaN in float64), the family's eager attention with sinks (finite in float64:
    the sink's logit is every row's finite maximum at worst)."""
    if config.model_type in SINK_FAMILIES:
        return "eager"
    return _reference_attention() if getattr(config, "attn_logit_softcapping", None) is not None else "sdpa"


def _reference_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REFERENCE_ATTENTION, _capped_reference)
    AttentionMaskInterface.register(REFERENCE_ATTENTION, sdpa_mask)
    return REFERENCE_ATTENTION


def batch(b=2, s=19, seed=1, pad_rows=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if pad_rows and b > 1:
        mask[1, :4] = 0  # left padding
    return ids, mask


def _step(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    live = inputs["attention_mask"].bool() if inputs.get("attention_mask") is not None else None
    logits = out.logits if live is None else out.logits[live]
    (logits.double() * torch.linspace(-1, 1, logits.shape[-1], dtype=torch.float64)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def assert_matches_reference(ref, plain, ours, **inputs):
    """Logits (real positions) and every parameter gradient within the 2x / 3x rule against float64."""
    r, rg = _step(ref, **inputs)
    p, pg = _step(plain, **inputs)
    o, og = _step(ours, **inputs)
    assert_within_rule(o, p, r, 2, name="logits")
    assert set(og) == set(pg) == set(rg), "the same parameters must receive gradients"
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert [n for n, _ in a.named_modules()] == [n for n, _ in b.named_modules()]


def kept_bytes_per_layer(build_layers, inputs):
    """Bytes one decoder layer keeps alive after forward: a 2-layer model minus a 1-layer one."""
    net = []
    for n in (1, 2):
        model = build_layers(n)
        held = []
        deltas = cpu_allocation_deltas(lambda m=model, h=held: h.append(m(**inputs).logits))
        net.append(sum(deltas))
        del held
    return net[1] - net[0]


def greedy(model, ids, n=6):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)


def check_family_basics(build, tmp_path, model_cls):
    """Rule against float64 (padded and not), state dict unchanged, save/load both ways, greedy generate."""
    ref, plain, ours = triple(build)
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
    assert_matches_reference(ref, plain, ours, input_ids=ids)
    assert_same_state(ours, plain)
    ours.save_pretrained(tmp_path / "ours")
    # a family that refuses SDPA at loading (Gemma2, for its soft-capping) loads on eager: only its state is compared
    back = model_cls.from_pretrained(tmp_path / "ours", attn_implementation="sdpa" if model_cls._supports_sdpa else
                                     "eager")
    assert_same_state(back, plain)
    plain.save_pretrained(tmp_path / "plain")
    ours2 = convert(model_cls.from_pretrained(tmp_path / "plain"))
    assert_same_state(ours2, plain)
    ours.eval()
    plain.eval()
    assert torch.equal(greedy(ours, ids[:1, :7]), greedy(plain, ids[:1, :7]))


def check_lora_both_orders(build, targets=("q_proj", "v_proj", "down_proj")):
    """PEFT LoRA before and after convert: adapters active, gradients as the unconverted LoRA model's."""
    from peft import LoraConfig, get_peft_model

    def lora(model):
        torch.manual_seed(5)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
        return get_peft_model(model, cfg)

    ref, plain, _ = triple(build)
    ids, mask = batch()
    base = copy.deepcopy(plain)  # get_peft_model adds its layers to the model it wraps: LoRA once per copy
    ref_l, plain_l = lora(ref), lora(plain)
    before = convert(lora(copy.deepcopy(base)))
    after = lora(convert(base))
    for model in (before, after):
        assert_matches_reference(ref_l, plain_l, model, input_ids=ids, attention_mask=mask)
        with model.disable_adapter():
            off = model(input_ids=ids).logits
        assert not torch.allclose(off, model(input_ids=ids).logits), "adapters must be active"


def check_modes_identical(model, ids, mask):
    """"none", "selective", "full", "attention-kept" (and transformers' own checkpointing) give the same
    bits."""
    from selective_ckpt import set_recompute

    results = []
    for mode in ("none", "selective", "full", "attention-kept", "hf"):
        if mode == "hf":
            set_recompute(model, "selective")
            if hasattr(model, "activation_checkpointing_enable"):  # the older name warns where this one exists
                model.activation_checkpointing_enable()
            else:
                model.gradient_checkpointing_enable()
            assert set_recompute.__module__ and all(m._selective_ckpt.recompute == "full" for m in _layers(model))
        else:
            set_recompute(model, mode)
        torch.manual_seed(3)
        results.append(_step(model, input_ids=ids, attention_mask=mask))
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
    for logits, grads in results[1:]:
        assert torch.equal(logits, results[0][0])
        for n, g in grads.items():
            assert torch.equal(g, results[0][1][n]), n


def _layers(model):
    return [m for m in model.modules() if hasattr(m, "_selective_ckpt")]


def check_window_applied(build, window=5):
    """One layer with a sliding window shorter than the sequence, against float64; a change to the first token
    leaves every position `window` or more behind it untouched (it is reached only through earlier layers)."""
    ref, plain, ours = triple(build)
    ids, _ = batch(b=1, s=13)
    assert_matches_reference(ref, plain, ours, input_ids=ids)
    other = ids.clone()
    other[:, 0] = (other[:, 0] + 1) % VOCAB
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits[:, window:], ours(input_ids=other).logits[:, window:])
