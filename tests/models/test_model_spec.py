"""Model specs (models/spec.py): each fact about a family's layer said once, checked when the spec is made, and what
the driver refuses by those facts before anything changes."""

import copy
import dataclasses

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.memory import LayerShape, MoE
from selective_ckpt.memory.parts import Attention, DenseMLP, Residual, Scalars
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


def test_a_v_norm_needs_norms_without_statistics():
    with pytest.raises(ValueError, match="a v norm only where the norms keep no statistics"):
        llama_shaped("x", "X", qk_norm=True, qk_norm_children=("q_norm", "k_norm", "v_norm"))
    spec = model_specs()["gemma4_text"]
    assert len(spec.qk_norm_children) == 3 and not spec.norm.keeps_stats


def test_the_form_comes_from_the_spec_alone():
    """OLMo 3 declares its form once (post-norm, projection-wide q/k norms, float32-scale norms): the one shape
    reader gives the estimate exactly that, with no reader of its own."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    from selective_ckpt.models.layer_shape import config_shape

    spec = model_specs()["olmo3"]
    assert spec.shape is None
    config = Olmo3Config(vocab_size=97, hidden_size=48, intermediate_size=88, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    shape = config_shape(Olmo3ForCausalLM(config).model.layers[0], config, spec)
    layer = LayerShape(**shape)
    form = (layer.part(Residual).form, layer.part(Attention).qk_norm, shape["norm_stats"])
    assert form == ("post-norm", "projection", False)
    assert shape["activation"] == "swiglu" and layer.part(MoE) is None and layer.part(Scalars) is None


def test_a_moe_block_is_read_without_a_stand_in_layer():
    """The MoE block's memory.MoE and activation come from its spec (MoESpec.memory, .activation) and the block."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from selective_ckpt.models.layer_shape import config_shape

    config = Qwen2MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=88, moe_intermediate_size=40,
                            shared_expert_intermediate_size=56, num_experts=5, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, mlp_only_layers=[1])
    spec = model_specs()["qwen2_moe"]
    sparse, dense = (config_shape(layer, config, spec) for layer in Qwen2MoeForCausalLM(config).model.layers)
    moe = LayerShape(**sparse).part(MoE)
    assert (moe.num_experts, moe.top_k, moe.expert_dim) == (5, 2, 40)
    assert (moe.shared_dim, moe.shared_gate, sparse["ffn_dim"]) == (56, True, 40)
    assert sparse["activation"] == dense["activation"] == "swiglu"
    assert LayerShape(**dense).part(MoE) is None and dense["ffn_dim"] == 88


def test_every_role_has_a_part_with_one_protocol():
    """Norms, attention, MLP, MoE block, kept mixer and dropouts: each part checks a module, gives its patched
    forward (or None: transformers' own) and the LayerShape fields of what it keeps."""
    import functools

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from selective_ckpt.models.layer_parts import AttentionPart, MLPPart, MoEPart, NormPart, part_of
    from selective_ckpt.models.patches import rms_norm_forward

    spec = model_specs()["qwen3_moe"]
    config = Qwen3MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=88, moe_intermediate_size=40,
                            num_experts=5, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, mlp_only_layers=[1])
    sparse, dense = Qwen3MoeForCausalLM(config).model.layers
    parts = {(child, type(part_of(spec, role, getattr(layer, child)))) for layer in (sparse, dense)
             for child, role in spec.children}
    assert parts == {("input_layernorm", NormPart), ("post_attention_layernorm", NormPart),
                     ("self_attn", AttentionPart), ("mlp", MoEPart), ("mlp", MLPPart)}
    for layer in (sparse, dense):
        for child, role in spec.children:
            part = part_of(spec, role, getattr(layer, child))
            part.check(getattr(layer, child), child, "qwen3_moe")
    norm, attn = NormPart(spec), AttentionPart(spec)
    assert norm.forward(sparse.input_layernorm) is rms_norm_forward
    q_norm = norm.forward(sparse.self_attn.q_norm, "qkv")
    assert isinstance(q_norm, functools.partial) and q_norm.keywords == {"kept": "qkv"}
    assert attn.forward(sparse.self_attn) is not None  # q/k norms before RoPE: RoPE's outputs rebuilt
    assert attn.shape(sparse.self_attn, config) == {"sliding_window": None, "head_dim": 16,
                                                    "parts": (Attention(qk_norm=True),)}
    assert MoEPart(spec).forward(sparse.mlp) is None  # MoESpec.patches patches the block and its experts
    assert MoEPart(spec).shape(sparse.mlp, config)["parts"][0].expert_dim == 40
    assert MLPPart(spec).shape(dense.mlp, config) == {"activation": "swiglu", "parts": (DenseMLP(gated=True),)}
    assert norm.shape(sparse.input_layernorm, config) == {"norm": "rmsnorm"}
    assert part_of(spec, "own", sparse.mlp) is None
