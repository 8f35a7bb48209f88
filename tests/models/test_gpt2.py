"""convert() on Hugging Face GPT-2: patched in place (Conv1D, names and parameters stay)."""

import pytest
import torch

from selective_ckpt import ConversionError, convert
from tests.models import hf_checks
from tests.models.hf_checks import VOCAB, batch, kept_bytes_per_layer, triple

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def config(**kw):
    base = dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    base.update(kw)
    return GPT2Config(**base)


def build(**kw):
    return lambda: GPT2LMHeadModel(config(**kw))


def test_rule_state_save_load_generate(tmp_path):
    hf_checks.check_family_basics(build(), tmp_path, GPT2LMHeadModel)


def test_dropouts_by_seed_modes_bit_identical():
    _, _, ours = triple(build(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.17))
    ids, mask = batch()
    hf_checks.check_modes_identical(ours, ids, mask)


def test_refusals():
    with pytest.raises(ConversionError, match="cross-attention"):
        convert(GPT2LMHeadModel(config(add_cross_attention=True)))
    model = GPT2LMHeadModel(config(activation_function="relu"))
    with pytest.raises(ConversionError, match="activation 'relu'.*gelu_new"):
        convert(model)
    assert model.config._attn_implementation != "selective_ckpt"


def _kept(converted):
    ids, _ = batch(b=2, s=24, pad_rows=False)

    def layers(n):
        torch.manual_seed(0)
        m = GPT2LMHeadModel(config(n_layer=n))
        m.config._attn_implementation = "sdpa"
        return convert(m) if converted else m

    return kept_bytes_per_layer(layers, {"input_ids": ids}), ids.numel()


def test_layer_keeps_less_than_sdpa():
    (ours, _), (sdpa, _) = _kept(True), _kept(False)
    assert sdpa > ours


@pytest.mark.xfail(strict=True, reason="a converted GPT-2 layer keeps 2h elements per token above the floor "
                   "(measured; not yet traced to its source)")
def test_layer_keeps_the_floor():
    """x, q/k/v (one c_attn buffer), o, x1, c_fc output, fp32 mean+rstd x2 and lse per token."""
    ids, _ = batch(b=2, s=24, pad_rows=False)

    def layers(n, converted):
        torch.manual_seed(0)
        m = GPT2LMHeadModel(config(n_layer=n))
        m.config._attn_implementation = "sdpa"
        return convert(m) if converted else m

    ours = kept_bytes_per_layer(lambda n: layers(n, True), {"input_ids": ids})
    sdpa = kept_bytes_per_layer(lambda n: layers(n, False), {"input_ids": ids})
    h = 64
    assert ours == ids.numel() * (4 * (h + 3 * h + h + h + 4 * h) + 4 * 4 + 4 * 4)
    assert sdpa > ours
