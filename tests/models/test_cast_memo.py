"""A converted layer's cast memo (keeping.pipeline.scope's `memo`): learned at the first call of each kind, and
learned again when the layer's parameters are frozen or unfrozen since (a frozen weight's cast under autocast
has no graph node, so the layer keeps watching casts), with the gradients of a model that never learned."""

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models import fused_layer
from tests.models import hf_checks, test_hf_llama
from tests.models.hf_checks import batch

pytest.importorskip("transformers")


def _state(model):
    return getattr(hf_checks._layers(model)[0], "_selective_ckpt")


def _step(model):
    ids, mask = batch()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=mask)
    out.logits.float().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_freezing_a_weight_relearns_the_memo_with_the_same_gradients(monkeypatch):
    # the memo belongs to the generic path: Llama's layers would run the fused one (models/fused_layer.py)
    monkeypatch.setattr(fused_layer, "layout_of", lambda layer: None)
    build = test_hf_llama.build(num_hidden_layers=1)
    torch.manual_seed(0)
    ours = convert(build().train())
    torch.manual_seed(0)
    fresh = convert(build().train())
    state = _state(ours)
    _step(ours)
    _step(ours)
    assert list(state.cast_memo.values()) == [False]  # every cast shows in the graph: no watcher
    for model in (ours, fresh):
        hf_checks._layers(model)[0].self_attn.q_proj.weight.requires_grad_(False)
    first = _step(ours)
    assert list(state.cast_memo.values()) == [True]  # learned again: the frozen weight's cast keeps the watcher
    again = _step(ours)
    reference = _step(fresh)
    assert first.keys() == reference.keys() == again.keys()
    for name in reference:
        assert torch.equal(first[name], reference[name]), name
        assert torch.equal(again[name], reference[name]), name


def test_lora_under_autocast_follows_every_cast_by_graph_with_the_watchers_gradients(monkeypatch):
    """Frozen base weights' casts are made by the LoRA layers' Linears (models/peft.py), the out projection's
    input is a view of attention's output: after the first call no layer watches, and the steps match, bit for
    bit, a model whose layers watch every call."""
    peft = pytest.importorskip("peft")
    from selective_ckpt.models.converted_layer import ConvertedLayerState

    # the memo belongs to the generic path: Llama's LoRA layers would run the fused one (lora_fusion.py)
    monkeypatch.setattr(fused_layer, "layout_of", lambda layer: None)

    def build():
        torch.manual_seed(0)
        model = convert(test_hf_llama.build(num_hidden_layers=2)().train())
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                          target_modules="all-linear", init_lora_weights=False))

    def steps(model):
        out = []
        for seed in (2, 3, 4):
            torch.manual_seed(seed)
            out.append(_step(model))
        return out

    ours = build()
    mine = steps(ours)
    for layer in hf_checks._layers(ours):
        assert list(getattr(layer, "_selective_ckpt").cast_memo.values()) == [False]
    monkeypatch.setattr(ConvertedLayerState, "memo_for", lambda self, params: None)  # the watcher at every call
    watched = steps(build())
    for got, want in zip(mine, watched):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("input_grad", (True, False))
def test_adapter_linear_forward_casts_as_autocast_does(input_grad):
    """The LoRA layers' Linears under autocast in a pipeline: outputs and gradients bit-identical to nn.Linear's own
    forward (autocast's casts), frozen weight and bias and an input with or without gradients."""
    from selective_ckpt.keeping import pipeline
    from selective_ckpt.models.patching import patch_forward
    from selective_ckpt.models.peft import adapter_linear_forward

    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 16)
    plain.weight.requires_grad_(False)
    plain.bias.requires_grad_(False)
    lora_a = torch.nn.Linear(8, 4, bias=False)
    ours_plain, ours_a = (torch.nn.Linear(8, 16), torch.nn.Linear(8, 4, bias=False))
    ours_plain.load_state_dict(plain.state_dict())
    ours_a.load_state_dict(lora_a.state_dict())
    ours_plain.requires_grad_(False)
    patch_forward(ours_plain, adapter_linear_forward)
    patch_forward(ours_a, adapter_linear_forward)
    x0 = torch.randn(2, 5, 8)

    def run(base, a):
        x = x0.clone().requires_grad_(input_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pipeline.scope("selective", layer_input=x, watch_casts=False):
                y = pipeline.discardable(x * 2, torch.mul, x, 2)
                out = base(y).sum(-1) + a(y).sum(-1)
        out.float().square().sum().backward()
        return out, x.grad, a.weight.grad

    want, got = run(plain, lora_a), run(ours_plain, ours_a)
    assert want[0].dtype == got[0].dtype == torch.bfloat16
    for w, g in zip(want, got):
        assert (w is None and g is None) or torch.equal(w, g)
