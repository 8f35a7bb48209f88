"""convert() on Hugging Face Llama: patched in place, checked against float64 and the unconverted model."""

import copy

import pytest
import torch

from selective_ckpt import ConversionError, convert
from tests.models import hf_checks
from tests.models.hf_checks import VOCAB, batch, kept_bytes_per_layer, triple

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    base.update(kw)
    return LlamaConfig(**base)


def build(**kw):
    return lambda: LlamaForCausalLM(config(**kw))




def test_rms_norm_with_weight_in_another_dtype_computes_as_transformers():
    """bf16 input, fp32 weight: transformers promotes to fp32; the patched norm gives the same bits."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from selective_ckpt.models.patches import rms_norm_forward
    from selective_ckpt.models.patching import patch_forward

    norm = LlamaRMSNorm(24)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    expected = norm(x)
    patch_forward(norm, rms_norm_forward)
    got = norm(x)
    assert got.dtype == expected.dtype == torch.float32
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_offset_of_a_spec_computes_as_gemma_norm(dtype):
    """A NormSpec offset of 1 patches the norm as y = x * rstd * (1 + w): Gemma's RMSNorm, against float64."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from selective_ckpt.models.layer_parts import norm_forward
    from selective_ckpt.models.patching import patch_forward
    from selective_ckpt.models.spec import NormSpec
    from tests.reference import assert_within_rule

    torch.manual_seed(0)
    norm = GemmaRMSNorm(24)
    torch.nn.init.normal_(norm.weight)
    ref = copy.deepcopy(norm).double()
    norm = norm.to(dtype)
    plain = copy.deepcopy(norm)
    patch_forward(norm, norm_forward(NormSpec("rmsnorm", "GemmaRMSNorm", 1.0)))
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    dy = torch.randn(3, 5, 24, dtype=torch.float64).to(dtype)
    outs = []
    for module, cast in ((norm, dtype), (plain, dtype), (ref, torch.float64)):
        xi = x.to(dtype).to(cast).requires_grad_(True)
        y = module(xi)
        y.backward(dy.to(cast))
        outs.append((y.detach(), xi.grad, module.weight.grad))
    for i, name in enumerate(("y", "dx", "dw")):
        assert_within_rule(outs[0][i], outs[1][i], outs[2][i], 2 if i == 0 else 3, name=name)




def test_modes_bit_identical_and_gradient_checkpointing_is_full():
    _, _, ours = triple(build(attention_dropout=0.17))
    ids, mask = batch()
    hf_checks.check_modes_identical(ours, ids, mask)


def test_refusals_change_nothing():
    model = LlamaForCausalLM(config())
    model.model.layers[0].mlp.act_fn = torch.nn.GLU()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConversionError, match="model type 'llama'.*GLU is not a deterministic elementwise"):
        convert(model)
    assert model.config._attn_implementation != "selective_ckpt"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    model = LlamaForCausalLM(config())
    model.model.layers[1].input_layernorm = torch.nn.LayerNorm(64)
    with pytest.raises(ConversionError, match=r"layers.1.input_layernorm.*LlamaRMSNorm"):
        convert(model)
    with pytest.raises(ConversionError, match="nothing to convert"):
        convert(torch.nn.Linear(3, 3))


@pytest.mark.parametrize("dropout", [0.0, 0.17])
def test_layer_keeps_the_floor(dropout):
    """Train mode, use_cache left on: one converted layer keeps x, q, k, v (Hkv heads), o, x1, gate, up, fp32 rstd
    x2 and lse (the floor), plus the attention dropout's 8-byte seed; "none" keeps the norm and product outputs."""
    ids, _ = batch(b=2, s=24, pad_rows=False)
    cfg = config()

    def layers(n, converted, mode="selective"):
        torch.manual_seed(0)
        m = LlamaForCausalLM(config(num_hidden_layers=n, attention_dropout=dropout)).train()
        m.config._attn_implementation = "sdpa"
        return convert(m, recompute=mode) if converted else m

    ours = kept_bytes_per_layer(lambda n: layers(n, True), {"input_ids": ids})
    kept_all = kept_bytes_per_layer(lambda n: layers(n, True, "none"), {"input_ids": ids})
    sdpa = kept_bytes_per_layer(lambda n: layers(n, False), {"input_ids": ids})
    h, hd, ffn = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads, cfg.intermediate_size
    per_token = 4 * (h + h + 2 * cfg.num_key_value_heads * hd + h + h + 2 * ffn) + 4 * 2 + 4 * 4
    seeds = 8 if dropout else 0
    assert ours == ids.numel() * per_token + seeds
    assert kept_all == ours + ids.numel() * 4 * (2 * h + ffn)  # both norm outputs and silu(gate) * up
    assert sdpa > kept_all


def test_fp32_auto_runs_the_cpu_flash_kernel_as_itself_and_matches_float64(monkeypatch):
    """A short fp32 batch without padding under the default setting: every layer's attention runs PyTorch's CPU flash
    kernel under its own autograd node (ops/attention_dispatch.py, CPU_FLASH_BELOW), and the converted model meets the
    rule against float64, as with our kernel."""
    from selective_ckpt import backend
    from selective_ckpt.ops import attention_dispatch

    monkeypatch.setenv(backend.ATTENTION_ENV, "auto")
    calls = []
    itself = attention_dispatch.cpu_flash_as_itself
    monkeypatch.setattr(attention_dispatch, "cpu_flash_as_itself", lambda *a: calls.append(1) or itself(*a))
    ref, plain, ours = triple(build())
    ids = batch(pad_rows=False)[0]
    hf_checks.assert_matches_reference(ref, plain, ours, input_ids=ids)
    assert len(calls) == ours.config.num_hidden_layers
