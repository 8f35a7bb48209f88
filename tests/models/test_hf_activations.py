"""A converted model's MLP applies the module's own activation, as the unconverted transformers model does.

Kernel activations (SiLU, exact and tanh GELU) run the fused kernels; any other elementwise activation
module is called as a module and its output rebuilt in backward; an activation swapped in before
convert and a hook on it are honoured. Each case is checked against float64 and plain transformers.
"""

import copy

import pytest
import torch
from torch import nn

from selective_ckpt import ConversionError, convert
from tests.models.hf_checks import VOCAB, assert_matches_reference, batch, kept_bytes_per_layer, triple

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402


def llama_config(**kw):
    return LlamaConfig(**(dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=88, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               pad_token_id=0) | kw))


def gpt2_config(**kw):
    return GPT2Config(**(dict(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=4, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0) | kw))


def swapped(build, child, make):
    """build(), then every MLP's activation child replaced by make()."""
    def run():
        model = build()
        for m in model.modules():
            if hasattr(m, child) and type(m).__name__.endswith("MLP"):
                setattr(m, child, make())
        return model
    return run


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "silu"])
def test_llama_mlp_honours_hidden_act(act):
    ref, plain, ours = triple(lambda: LlamaForCausalLM(llama_config(hidden_act=act)))
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("build", [
    swapped(lambda: LlamaForCausalLM(llama_config()), "act_fn", nn.GELU),
    swapped(lambda: LlamaForCausalLM(llama_config()), "act_fn", lambda: nn.GELU(approximate="tanh")),
    swapped(lambda: LlamaForCausalLM(llama_config()), "act_fn", lambda: nn.LeakyReLU(0.1)),
    swapped(lambda: GPT2LMHeadModel(gpt2_config()), "act", nn.ReLU),
    swapped(lambda: GPT2LMHeadModel(gpt2_config()), "act", nn.GELU),
], ids=["llama-gelu", "llama-gelu-tanh", "llama-leaky-relu", "gpt2-relu", "gpt2-gelu"])
def test_activation_swapped_before_convert_is_honoured(build):
    ref, plain, ours = triple(build)
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("build, child", [(lambda: LlamaForCausalLM(llama_config()), "act_fn"),
                                          (lambda: GPT2LMHeadModel(gpt2_config()), "act")], ids=["llama", "gpt2"])
def test_forward_hook_on_the_activation_is_called(build, child):
    """A hook that changes the activation's output: the converted model calls it and computes with its result."""
    calls = []

    def hook(module, args, out):
        calls.append(type(module).__name__)
        return out * 0.5

    def hooked():
        model = build()
        for m in model.modules():
            if hasattr(m, child) and type(m).__name__.endswith("MLP"):
                getattr(m, child).register_forward_hook(hook)
        return model

    ref, plain, ours = triple(hooked)
    ids, mask = batch()
    calls.clear()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
    assert len(calls) == 3 * 2  # each of the three models' two layers, once per forward


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_any_activation_keeps_only_gate_and_up(act):
    """hidden_act "gelu" runs the exact-GELU gated kernel, "relu" the module itself: both keep the floor."""
    ids, _ = batch(b=2, s=24, pad_rows=False)
    cfg = llama_config(hidden_act=act)

    def layers(n):
        torch.manual_seed(0)
        m = LlamaForCausalLM(llama_config(hidden_act=act, num_hidden_layers=n)).train()
        return convert(m)

    h, hd, ffn = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads, cfg.intermediate_size
    per_token = 4 * (h + h + 2 * cfg.num_key_value_heads * hd + h + h + 2 * ffn) + 4 * 2 + 4 * 4
    assert kept_bytes_per_layer(layers, {"input_ids": ids}) == ids.numel() * per_token


def test_an_activation_that_cannot_be_rebuilt_is_refused():
    model = LlamaForCausalLM(llama_config())
    model.model.layers[1].mlp.act_fn = nn.Softmax(dim=-1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConversionError, match=r"layers.1.mlp.*Softmax is not a deterministic elementwise"):
        convert(model)
    assert model.config._attn_implementation != "selective_ckpt"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
