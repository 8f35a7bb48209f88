"""A LoRA adapter swapped after convert for another of the same size: the converted layers see the new one.

The layers count the same modules before and after such a swap; each compares its modules by identity, so
the new adapter's dropouts keep seeds as the old one's did, and the step is the step of a model converted
with the new adapter from the start.
"""

import copy

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models.patching import PATCHED
from tests.models import hf_checks, test_hf_llama
from tests.models.hf_checks import assert_matches_reference, batch, triple

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _config(dropout):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout, init_lora_weights=False)


def _with_adapter(model, dropout, seed, name="default"):
    torch.manual_seed(seed)
    return peft.get_peft_model(model, _config(dropout), adapter_name=name)


def _module_counts(model):
    return [sum(1 for _ in layer.modules()) for layer in hf_checks._layers(model)]


def _swapped(converted_model, dropout):
    """Adapter "default" on the converted model, one training step, then swapped for "b" of the same size."""
    model = _with_adapter(converted_model, dropout, seed=5)
    ids, mask = batch()
    hf_checks._step(model, input_ids=ids, attention_mask=mask)
    counts = _module_counts(model)
    torch.manual_seed(6)
    model.add_adapter("b", _config(dropout))
    model.set_adapter("b")
    model.delete_adapter("default")
    assert _module_counts(model) == counts, "a swap of equal size"
    return model


def _lora_dropouts(model):
    return [d for n, d in model.named_modules() if n.split(".")[-2:-1] == ["lora_dropout"]]


def test_swapped_adapter_is_used_gradients_against_the_unconverted_reference():
    ref, plain, ours = triple(test_hf_llama.build(num_hidden_layers=1))
    ref_b = _with_adapter(ref, 0.0, seed=6, name="b")
    plain_b = _with_adapter(plain, 0.0, seed=6, name="b")
    swapped = _swapped(ours, 0.0)
    hf_checks.assert_same_state(swapped, plain_b)
    ids, mask = batch()
    # the same parameters get gradients as in plain_b, whose only adapter is "b"
    assert_matches_reference(ref_b, plain_b, swapped, input_ids=ids, attention_mask=mask)


def test_swapped_adapter_dropout_keeps_a_seed():
    """With LoRA dropout on, the new adapter's dropouts are patched as the old one's were: the same bits as the
    model converted with the new adapter from the start."""
    torch.manual_seed(0)
    plain = test_hf_llama.build(num_hidden_layers=1)().train()
    plain.config._attn_implementation = "sdpa"
    swapped = _swapped(convert(copy.deepcopy(plain)), 0.1)
    direct = convert(_with_adapter(copy.deepcopy(plain), 0.1, seed=6, name="b"))
    hf_checks.assert_same_state(swapped, direct)
    ids, mask = batch()
    torch.manual_seed(3)
    want = hf_checks._step(direct, input_ids=ids, attention_mask=mask)
    torch.manual_seed(3)
    got = hf_checks._step(swapped, input_ids=ids, attention_mask=mask)
    dropouts = _lora_dropouts(swapped)
    assert dropouts and all(type(d) is torch.nn.Dropout and PATCHED in vars(d) for d in dropouts)
    assert torch.equal(got[0], want[0])
    assert set(got[1]) == set(want[1])
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n
