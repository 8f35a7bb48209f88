"""The fused loss head reads the model afresh at every step: successive training steps of a converted causal LM
against the unconverted model while the batch shape, the head's weight, the head module, the tying and the logit
scale change between them; and the output it returns without logits is a consistent ModelOutput."""

import copy

import pytest
import torch
from torch import nn

from selective_ckpt import convert
from tests.models.hf_checks import VOCAB, batch

transformers = pytest.importorskip("transformers")
from transformers import GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, use_cache=False)


def _pair(cls=LlamaForCausalLM, config=LlamaConfig, **kw):
    torch.manual_seed(0)
    plain = cls(config(**SHAPE, **kw)).train()
    plain.config._attn_implementation = "sdpa"
    return plain, convert(copy.deepcopy(plain))


def _assert_same_step(plain, ours, ids, labels=None):
    labels = ids if labels is None else labels
    results = []
    for model in (plain, ours):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (p, pg), (o, og) = results
    torch.testing.assert_close(o, p, rtol=1e-5, atol=1e-6, equal_nan=True)  # (1, 1): nothing left to predict
    assert set(og) == set(pg)
    for n in pg:
        torch.testing.assert_close(og[n], pg[n], rtol=1e-4, atol=1e-6, msg=n)


def _both(plain, ours, change):
    for model in (plain, ours):
        change(model)


def test_shapes_change_between_steps():
    plain, ours = _pair()
    for b, s in ((2, 19), (3, 7), (1, 1)):
        ids, _ = batch(b=b, s=s, seed=b * s)
        labels = ids.clone()
        labels[0, : s // 2] = -100
        _assert_same_step(plain, ours, ids, labels)


def test_head_weight_and_module_replaced_between_steps():
    plain, ours = _pair()
    ids, _ = batch(seed=5)
    _assert_same_step(plain, ours, ids)
    torch.manual_seed(1)
    weight = torch.randn(VOCAB, 64) * 0.05
    _both(plain, ours, lambda m: setattr(m.lm_head, "weight", nn.Parameter(weight.clone())))
    _assert_same_step(plain, ours, ids)
    head = nn.Linear(64, VOCAB, bias=True)
    _both(plain, ours, lambda m: setattr(m, "lm_head", copy.deepcopy(head)))
    _assert_same_step(plain, ours, ids)
    assert ours.lm_head.bias.grad is not None


def test_tied_then_untied_between_steps():
    plain, ours = _pair(tie_word_embeddings=True)
    ids, _ = batch(seed=6)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    _assert_same_step(plain, ours, ids)
    _both(plain, ours, lambda m: setattr(m.lm_head, "weight", nn.Parameter(m.lm_head.weight.detach().clone())))
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    _assert_same_step(plain, ours, ids)


def test_logit_scale_changed_between_steps():
    """Granite divides its logits by config.logits_scaling in its forward: a new value holds from the next step."""
    plain, ours = _pair(GraniteForCausalLM, GraniteConfig, logits_scaling=4.0)
    ids, _ = batch(seed=7)
    _assert_same_step(plain, ours, ids)
    _both(plain, ours, lambda m: setattr(m.config, "logits_scaling", 0.5))
    _assert_same_step(plain, ours, ids)


def test_output_without_logits_is_consistent():
    plain, ours = _pair()
    ids, _ = batch(seed=8)
    out, want = ours(input_ids=ids, labels=ids), plain(input_ids=ids, labels=ids)
    assert type(out) is type(want)
    assert out.logits is None and "logits" not in out
    assert list(out.keys()) == [k for k in want.keys() if k != "logits"]
    assert out.to_tuple()[0] is out.loss is out["loss"] is out[0]
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    tup = ours(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(tup, tuple) and len(tup) == len(want.to_tuple()) - 1
