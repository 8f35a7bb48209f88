"""Converted Hugging Face models with the memory planner and under torch.compile."""

import copy

import pytest
import torch

from selective_ckpt import convert, set_recompute
from selective_ckpt.memory import estimate, plan
from tests.models.hf_checks import VOCAB, batch, kept_bytes_per_layer
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402


def llama(n=2):
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=88, num_hidden_layers=n,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=0))


def gpt2(n=2):
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=n, n_head=4, n_inner=136,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["selective", "none"])
def test_estimate_of_a_converted_layer_is_what_it_keeps(build, mode):
    """The planner's per-layer estimate, from the shape it reads off the converted model, equals the measurement."""
    ids, _ = batch(b=2, s=21, pad_rows=False)

    def layers(n):
        torch.manual_seed(0)
        m = build(n).train()
        return convert(m, recompute=mode)

    shape = layers(1).model.layers[0] if build is llama else layers(1).transformer.h[0]
    fields = shape._selective_ckpt.shape()
    expected = estimate(fields.pop("hidden_dim"), fields.pop("num_heads"), 21, 2, fields.pop("dtype"),
                        fields.pop("mlp_ratio"), mode, **fields)
    assert kept_bytes_per_layer(layers, {"input_ids": ids}) == expected


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
def test_plan_and_set_recompute_on_a_converted_model(build):
    torch.manual_seed(0)
    model = convert(build(4).train())
    b, s = 2, 21
    every = plan(model, b, s, 1e12)
    assert list(every) == ["none"] * 4
    tight = plan(model, b, s, every.kept_bytes * 0.6)
    # a layer rebuilt under a checkpoint ("attention-kept" costs less than "full": attention is not run again)
    assert {"full", "attention-kept"} & set(tight) and tight.kept_bytes <= every.kept_bytes * 0.6
    assert set_recompute(model, tight) == list(tight)
    layers = [m for m in model.modules() if hasattr(m, "_selective_ckpt")]
    assert [m._selective_ckpt.recompute for m in layers] == list(tight)
    ids, _ = batch(b=b, s=s, pad_rows=False)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "right-padded"])
def test_torch_compile_matches_eager(padded):
    """torch.compile of a converted Llama (CPU, inductor; one graph: tests/models/test_compile_graphs.py): the same
    loss and gradients as eager, and gradients within the rule against the unconverted model in float64; with
    right padding too (the key padding described inside the graph)."""
    torch.manual_seed(0)
    plain = llama().train()
    ref = copy.deepcopy(plain).double()
    eager = convert(copy.deepcopy(plain))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    ids, mask = batch(b=2, s=13, pad_rows=False)
    if padded:
        mask[1, 9:] = 0
    inputs = dict(input_ids=ids, labels=ids, attention_mask=mask if padded else None)
    results = []
    for model, params in ((eager, eager), (compiled, compiled_model)):
        loss = model(**inputs).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in params.named_parameters()}))
    (le, ge), (lc, gc) = results
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    assert set(ge) == set(gc)
    for n in ge:
        torch.testing.assert_close(gc[n], ge[n], rtol=1e-4, atol=1e-6, msg=n)
    for model in (plain, ref):
        model(**inputs).loss.backward()
    gp, gr = ({n: p.grad for n, p in m.named_parameters()} for m in (plain, ref))
    for n in gc:
        assert_within_rule(gc[n], gp[n], gr[n], 3, name=n)
