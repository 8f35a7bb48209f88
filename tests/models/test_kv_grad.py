"""Queries against earlier keys with gradients on (a decoding loop without no_grad, PEFT's prefix tuning): such
calls run transformers' SDPA attention, warned once, and follow the unconverted model."""

import copy
import inspect
import warnings
from contextlib import nullcontext

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models import attention as converted_attention
from tests.models.families import by_name
from tests.models.hf_checks import batch, triple
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")


def _cache(model, past):
    """The kv cache as a keyword argument: `cache`, transformers' name since it deprecated `past_key_values`,
    where the model's forward takes it."""
    return {"cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values": past}


def _two_calls(model, ids, split, mask=None):
    """A forward over ids[:, :split] filling a cache, then one over the rest against it, gradients on; the
    second call's logits and every parameter's gradient of a loss over both calls' logits."""
    model.zero_grad(set_to_none=True)
    first = model(input_ids=ids[:, :split], attention_mask=None if mask is None else mask[:, :split], use_cache=True)
    second = model(input_ids=ids[:, split:], attention_mask=mask, **_cache(model, first.past_key_values),
                   use_cache=True)
    weight = torch.linspace(-1, 1, second.logits.shape[-1], dtype=torch.float64)
    (first.logits.double().square().mean() + (second.logits.double() * weight).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return second.logits.detach(), grads


@pytest.mark.parametrize("name", ["llama", "gpt_neox"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_kv_cache_with_gradients_follows_the_unconverted_model(name, padded, monkeypatch):
    """transformers' past-key-values check (7 cached tokens, 3 new: Sq=3, Sk=10) with gradients: the second
    call's logits and all gradients (through the cache into the first call) within the rule against float64,
    and warned once."""
    monkeypatch.setattr(converted_attention, "_WARNED", set())
    ref, plain, ours = triple(by_name(name).build())
    ids, mask = batch(b=2, s=10, pad_rows=padded)
    r, rg = _two_calls(ref, ids, 7, mask if padded else None)
    p, pg = _two_calls(plain, ids, 7, mask if padded else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, og = _two_calls(ours, ids, 7, mask if padded else None)
    said = [w for w in caught if "earlier keys" in str(w.message)]
    assert len(said) == 1 and "SDPA" in str(said[0].message)
    assert_within_rule(o, p, r, 2, name="logits")
    assert set(og) == set(pg) == set(rg)
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")


def test_decoding_loop_with_gradients(monkeypatch):
    """Token by token (Sq=1) after a prompt, gradients on: the unconverted model's logits at each step, and the
    first step against the cache warned."""
    monkeypatch.setattr(converted_attention, "_WARNED", set())
    torch.manual_seed(0)
    plain = by_name("llama").build()().train()
    plain.config._attn_implementation = "sdpa"
    ours = convert(copy.deepcopy(plain))
    ids, _ = batch(b=2, s=9, pad_rows=False)
    outs = []
    for model in (plain, ours):
        past, logits = None, []
        for t in range(5, 10):
            step = ids[:, :5] if past is None else ids[:, t - 1:t]
            if model is ours and past is not None and t == 6:
                with pytest.warns(UserWarning, match="earlier keys"):
                    out = model(input_ids=step, **_cache(model, past), use_cache=True)
            else:
                out = model(input_ids=step, **_cache(model, past), use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[:, -1])
        torch.stack(logits).sum().backward()
        outs.append((torch.stack(logits).detach(), model.model.embed_tokens.weight.grad.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-6)


def _prefix(model):
    from peft import PrefixTuningConfig, get_peft_model

    torch.manual_seed(3)
    return get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5))


@pytest.mark.parametrize("order", ["prefix-then-convert", "convert-then-prefix"])
def test_peft_prefix_tuning(order, monkeypatch):
    """PEFT's prefix tuning hands every layer 5 virtual tokens' keys and values as a cache: a training step
    on a left-padded batch with labels gives the unconverted prefix-tuned model's loss and prefix gradients
    (within the rule against float64), warned as a call against earlier keys, and an optimizer step changes only
    the prefix."""
    pytest.importorskip("peft")
    monkeypatch.setattr(converted_attention, "_WARNED", set())
    ref, plain, _ = triple(by_name("llama").build())
    ref_p, plain_p = _prefix(ref), _prefix(plain)
    ours = convert(_prefix(copy.deepcopy(plain))) if order == "prefix-then-convert" else \
        _prefix(convert(copy.deepcopy(plain)))
    ids, mask = batch(b=2, s=9)
    results = []
    for model in (ref_p, plain_p, ours):
        model.train()
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # peft 0.21's prefix tuning hands the base model its virtual tokens as past_key_values, the keyword
            # transformers 5.25 deprecates for `cache`: peft's call, passed through our loss head unchanged
            warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)
            with pytest.warns(UserWarning, match="earlier keys") if model is ours else nullcontext():
                out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert list(grads) == ["prompt_encoder.default.embedding.weight"]
        results.append((out.loss.detach(), grads))
    (r, rg), (p, pg), (o, og) = results
    assert_within_rule(o.double(), p.double(), r, 2, floor=1e-6, name="loss")
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-6, name=f"grad {n}")
    frozen = {n: t.clone() for n, t in ours.named_parameters() if not t.requires_grad}
    torch.optim.SGD([t for t in ours.parameters() if t.requires_grad], lr=0.1).step()
    assert all(torch.equal(t, frozen[n]) for n, t in ours.named_parameters() if not t.requires_grad)
