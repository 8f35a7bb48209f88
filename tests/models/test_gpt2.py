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
    model = GPT2LMHeadModel(config())
    model.transformer.h[1].mlp.act = torch.nn.RReLU()
    with pytest.raises(ConversionError, match=r"h.1.mlp.*RReLU is not a deterministic elementwise"):
        convert(model)
    assert model.config._attn_implementation != "selective_ckpt"


@pytest.mark.parametrize("pdrop", [0.0, 0.1])
def test_layer_keeps_the_floor(pdrop):
    """Train mode, use_cache left on: x, q/k/v (one c_attn buffer), o, x1, c_fc output, fp32 mean+rstd x2, lse.

    With dropout each of the layer's three dropout sites (attention, two residual) adds its 8-byte seed.
    """
    ids, _ = batch(b=2, s=24, pad_rows=False)

    def layers(n, converted):
        torch.manual_seed(0)
        m = GPT2LMHeadModel(config(n_layer=n, resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop)).train()
        m.config._attn_implementation = "sdpa"
        return convert(m) if converted else m

    ours = kept_bytes_per_layer(lambda n: layers(n, True), {"input_ids": ids})
    sdpa = kept_bytes_per_layer(lambda n: layers(n, False), {"input_ids": ids})
    h = 64
    seeds = 3 * 8 if pdrop else 0
    assert ours == ids.numel() * (4 * (h + 3 * h + h + h + 4 * h) + 4 * 4 + 4 * 4) + seeds
    assert sdpa > ours


def test_training_forward_still_fills_the_kv_cache():
    """Attention reads the layer's own k, v; the cache returned by a use_cache forward is the unconverted one's."""
    _, plain, ours = triple(build())
    ids, mask = batch()
    a = plain(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    b = ours(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    assert len(a.layers) == len(b.layers) == 2
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(lb.keys, la.keys)
        torch.testing.assert_close(lb.values, la.values)
    assert "update" not in vars(b), "the cache's own update method is restored after each layer"
