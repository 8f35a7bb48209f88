"""bitsandbytes bases beyond NF4 with bf16 compute: 8-bit Linear8bitLt, 4-bit FP4, and 4-bit compute
dtypes bf16, fp16 and fp32; and fp16 autocast over fp32 weights.

Every base is loaded by transformers (BitsAndBytesConfig) and prepared with peft's
prepare_model_for_kbit_training, then gets LoRA on all linear layers with and without dropout.
For each: the bytes a converted decoder layer keeps after a training forward (3-layer minus
1-layer allocator deltas, the recompute active) equal layer_estimate; loss, logits and every
gradient follow the unconverted model within the 2x / 3x rule against a float64 copy with the
dequantized weights.

On CPU in training, bitsandbytes 0.50 runs Linear8bitLt through MatMul8bitFp (dequantize, then
a dense matmul), which holds its input as a plain attribute of the autograd context (not through
save_for_backward) though its backward reads it only for a weight gradient a frozen int8 weight
never has; convert drops that reference after forward.
"""

import copy

import pytest
import torch

from selective_ckpt import convert, set_recompute
from selective_ckpt.models.configuration import layer_estimate
from tests.models.test_training_configs import (
    B,
    S,
    _decoder_layers,
    _float64_reference,
    _grads,
    _held,
    _ids,
    autocast_dtype,
    build,
)
from tests.reference import assert_within_rule

pytest.importorskip("bitsandbytes")

BASES = ("int8", "fp4-bf16", "fp4-fp16", "nf4-fp16", "nf4-fp32")
LORA = ("qlora", "qlora-dropout")


def _kept_per_layer(family, config, tmp_path, quant=None):
    ids = _ids()
    held = []
    for layers in (1, 3):
        model = convert(build(family, config, layers, tmp_path, quant or "nf4-bf16"))
        held.append(_held(model, ids, config))
    return (held[1] - held[0]) / 2, _decoder_layers(model)[1]


@pytest.mark.parametrize("config", LORA)
@pytest.mark.parametrize("quant", BASES)
def test_kept_bytes_per_layer_equal_the_estimate(quant, config, tmp_path):
    per_layer, layer = _kept_per_layer("llama", config, tmp_path, quant)
    expected = layer_estimate(layer, S, B, autocast_dtype(config))
    assert per_layer == expected, (per_layer, layer_estimate(layer, S, B, None, breakdown=True))


@pytest.mark.parametrize("family", ("mistral", "qwen2"))
def test_int8_kept_bytes_on_other_families(family, tmp_path):
    per_layer, layer = _kept_per_layer(family, "qlora-dropout", tmp_path, "int8")
    assert per_layer == layer_estimate(layer, S, B, None)


@pytest.mark.parametrize("config", ("autocast-fp16", "autocast-fp16-lora", "autocast-fp16-qlora-dropout"))
def test_fp16_autocast_kept_bytes_equal_the_estimate(config, tmp_path):
    per_layer, layer = _kept_per_layer("llama", config, tmp_path)
    assert per_layer == layer_estimate(layer, S, B, torch.float16), layer_estimate(layer, S, B, torch.float16,
                                                                                   breakdown=True)


def _follows_transformers(family, config, tmp_path, quant="nf4-bf16", loss_floor=1e-3):
    plain = build(family, config, 2, tmp_path, quant)
    ref = _float64_reference(plain)
    ref.config._attn_implementation = "sdpa"
    ours = convert(copy.deepcopy(plain))
    ids = _ids()
    r_loss, r_logits, r_grads = _grads(ref, ids, config, autocast=False)
    p_loss, p_logits, p_grads = _grads(plain, ids, config)
    o_loss, o_logits, o_grads = _grads(ours, ids, config)
    assert_within_rule(o_logits, p_logits, r_logits, 2, name="logits")
    assert_within_rule(o_loss, p_loss, r_loss, 2, floor=loss_floor, name="loss")
    assert set(o_grads) == set(p_grads) == set(r_grads) and o_grads
    for n in r_grads:
        assert_within_rule(o_grads[n], p_grads[n], r_grads[n], 3, floor=1e-5, name=f"grad {n}")


@pytest.mark.parametrize("quant", BASES)
def test_loss_and_gradients_follow_transformers(quant, tmp_path):
    _follows_transformers("llama", "qlora", tmp_path, quant)


@pytest.mark.parametrize("quant", ("int8", "fp4-fp16"))
def test_dropout_bit_identical_across_modes(quant, tmp_path):
    """With lora_dropout the masks are the contract's (not transformers'): every recompute mode gives the same bits."""
    model = convert(build("llama", "qlora-dropout", 2, tmp_path, quant))
    ids = _ids()
    results = []
    for mode in ("none", "selective", "full"):
        set_recompute(model, mode)
        torch.manual_seed(7)
        results.append(_grads(model, ids, "qlora-dropout"))
    for loss, _, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert grads.keys() == results[0][2].keys()
        for n, g in grads.items():
            assert torch.equal(g, results[0][2][n]), n


@pytest.mark.parametrize("config", ("autocast-fp16", "autocast-fp16-lora"))
def test_fp16_autocast_follows_transformers(config, tmp_path):
    _follows_transformers("llama", config, tmp_path)
