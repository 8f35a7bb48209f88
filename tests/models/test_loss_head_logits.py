"""The traps of a converted causal LM said where users meet them: in training with labels the fused loss head
returns logits=None (warned once, naming the switch), `return_logits(model)` returns them as the unconverted
model does, and config.output_attentions set after convert is transformers' own refusal while the per-call
flag works."""

import copy
import warnings

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.memory.peak import cpu_allocation_deltas
from selective_ckpt.models import loss_head
from selective_ckpt.models.loss_head import return_logits
from tests.models.families import by_name
from tests.models.hf_checks import batch

transformers = pytest.importorskip("transformers")


def _pair(name="llama", **kw):
    torch.manual_seed(0)
    plain = by_name(name).build(**kw)().train()
    plain.config._attn_implementation = "eager" if name == "gemma2" else "sdpa"
    return plain, convert(copy.deepcopy(plain))


def _step(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_logits_none_is_warned_once_naming_the_switch(monkeypatch):
    monkeypatch.setattr(loss_head, "_SAID", set())
    _, ours = _pair()
    ids, mask = batch()
    with pytest.warns(UserWarning, match=r"logits=None.*return_logits\(model\)"):
        out = ours(input_ids=ids, attention_mask=mask, labels=ids)
    assert out.logits is None and out.loss is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(input_ids=ids, attention_mask=mask, labels=ids)  # once only
        ours.eval()
        assert ours(input_ids=ids, attention_mask=mask, labels=ids).logits is not None  # eval: no fused head


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_return_logits_gives_the_unconverted_outputs(name):
    """With the switch on, a training step with labels returns the unconverted model's logits and loss and
    every gradient (Gemma2: its final-logit soft-cap applied by transformers' own head); off, logits=None."""
    plain, ours = _pair(name)
    ids, mask = batch()
    assert return_logits(ours) == 1
    (p, pg), (o, og) = _step(plain, ids, mask), _step(ours, ids, mask)
    assert o.logits is not None and o.logits.requires_grad
    torch.testing.assert_close(o.logits, p.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.loss, p.loss, rtol=1e-6, atol=1e-6)
    for n in pg:
        torch.testing.assert_close(og[n], pg[n], rtol=1e-4, atol=1e-6, msg=n)
    assert copy.deepcopy(ours)(input_ids=ids, labels=ids).logits is not None, "deepcopy keeps the switch"
    assert set(ours.state_dict()) == set(plain.state_dict())
    return_logits(ours, False)
    out, grads = _step(ours, ids, mask)
    assert out.logits is None
    torch.testing.assert_close(out.loss, p.loss, rtol=1e-5, atol=1e-6)


def test_return_logits_through_a_peft_wrapper_and_refused_without_a_head():
    from peft import LoraConfig, get_peft_model

    _, ours = _pair()
    wrapped = get_peft_model(ours, LoraConfig(r=4, target_modules=["q_proj"]))
    assert return_logits(wrapped) == 1
    ids, _ = batch(pad_rows=False)
    assert wrapped(input_ids=ids, labels=ids).logits is not None
    with pytest.raises(ValueError, match="no causal LM converted"):
        return_logits(torch.nn.Linear(2, 2))
    base = transformers.LlamaModel(by_name("llama").config(**by_name("llama").tiny))
    with pytest.raises(ValueError, match="LlamaModel"):
        return_logits(convert(base))


def test_return_logits_costs_the_logits_and_their_log_softmax():
    """What a forward with labels leaves alive until backward grows by the logits (the model's dtype) and
    the loss's float32 log-softmax, less the fused head's gradients formed in forward."""
    vocab, b, s, h = 1000, 2, 24, 64
    _, ours = _pair(vocab_size=vocab)
    ids = torch.randint(0, vocab, (b, s))
    kept = {}
    for on in (False, True):
        return_logits(ours, on)
        held = []
        kept[on] = sum(cpu_allocation_deltas(lambda held=held: held.append(ours(input_ids=ids, labels=ids))))
        held.clear()
    n = b * s
    logits_and_log_softmax = n * vocab * 4 + n * vocab * 4
    fused_gradients = vocab * h * 4 + n * h * 4  # dweight and dhidden, formed in forward
    assert abs((kept[True] - kept[False]) - (logits_and_log_softmax - fused_gradients)) <= 16 * 1024


def test_output_attentions_in_the_config_after_convert_is_refused_per_call_works(monkeypatch):
    """transformers refuses config.output_attentions for any attention but eager (ours included); the per-call
    flag returns the weights (computed by the family's eager attention for that call)."""
    from selective_ckpt.models import attention

    monkeypatch.setattr(attention, "_WARNED", set())
    _, ours = _pair()
    ids, _ = batch(pad_rows=False)
    with pytest.raises(ValueError, match="output_attentions"):
        ours.config.output_attentions = True
    with pytest.warns(UserWarning):
        out = ours(input_ids=ids, output_attentions=True)
    assert len(out.attentions) == ours.config.num_hidden_layers
