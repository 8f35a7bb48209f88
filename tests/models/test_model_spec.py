"""Model specs (models/spec.py): each fact about a family's layer said once, checked when the spec is made, and what
the driver refuses by those facts before anything changes."""

import copy
import dataclasses

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.models import model_specs
from selective_ckpt.models.spec import GATE_UP_CHILDREN, MLPSpec, llama_shaped

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=88, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_the_mlp_names_its_activation_child():
    assert MLPSpec("M", "gate_up", GATE_UP_CHILDREN).activation == "act_fn"
    assert MLPSpec("M", "packed_gate_up", ("gate_up_proj", "down_proj", "activation_fn")).activation == "activation_fn"
    assert MLPSpec("M", "fc", ("c_fc", "act", "c_proj", "dropout")).activation == "act"
    assert MLPSpec("M", "fc", ("w_in", "w_out", "gelu"), activation="gelu").activation == "gelu"
    assert {s.mlp.activation in s.mlp.children for s in model_specs().values()} == {True}


def test_a_spec_refuses_facts_that_disagree():
    with pytest.raises(ValueError, match="activation child 'act'.*not one of its children"):
        llama_shaped("x", "X", mlp=MLPSpec("XMLP", "gate_up", GATE_UP_CHILDREN, activation="act"))
    with pytest.raises(ValueError, match=r"optional attention children \['w_proj'\]"):
        llama_shaped("x", "X", attention_optional=("w_proj",))
    assert llama_shaped("x", "X", qk_norm=True, attention_optional=("q_norm", "k_norm")).attention_all == (
        "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def test_roles_name_the_children():
    spec = model_specs()["gpt_neox"]
    assert (spec.child("attention"), spec.child("mlp"), spec.child("mixer")) == ("attention", "mlp", None)
    assert (spec.count("norm"), spec.count("dropout")) == (2, 2)


def test_an_attention_lacking_a_child_its_spec_requires_is_refused_unchanged():
    model = _llama()
    model.model.layers[1].self_attn.v_proj = None
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConversionError, match=r"layers\.1\.self_attn \(LlamaAttention, model type 'llama'\) lacks "
                                              r"\['v_proj'\]"):
        convert(model)
    assert model.config._attn_implementation != "selective_ckpt"
    assert before.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_an_optional_attention_child_may_be_missing(monkeypatch):
    """A child the spec lists in attention_optional (GLM-4.5's q/k norms by config) may be absent."""
    from selective_ckpt import models

    spec = model_specs()["llama"]
    lenient = dataclasses.replace(spec, attention_optional=("v_proj",))
    monkeypatch.setitem(models.model_specs(), "llama", lenient)
    model = _llama()
    model.model.layers[1].self_attn.v_proj = None
    layers, _ = models.hf.plan(model, lenient, "llama")
    assert len(layers) == 2
