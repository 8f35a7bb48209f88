"""Gemma2 and Gemma3 text specifics: sliding and global layers alternating (with Gemma3's two rope bases)
against float64, attention-logit soft-capping in the attention kernels (Gemma2's released defaults
included), final-logit soft-capping through the fused loss head, and the refusal of what the converted
model does not reproduce (bidirectional attention), raised before anything changes."""

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.models.patching import PATCHED
from selective_ckpt.registry import recomputable_layers, state_of
from tests.models.families.gemma import FAMILIES
from tests.models.hf_checks import assert_matches_reference, batch, triple
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")

SANDWICH = [f for f in FAMILIES if f.name in ("gemma2", "gemma3_text")]
sandwich = pytest.mark.parametrize("family", SANDWICH, ids=str)


def _alternating(family):
    # Gemma2 alternates by default; Gemma3 with a pattern of 2 (sliding, global, sliding, global)
    extra = {"sliding_window_pattern": 2} if family.name == "gemma3_text" else {}
    return family.build(num_hidden_layers=4, **extra)


@sandwich
def test_sliding_and_global_layers_alternate(family):
    ref, plain, ours = triple(_alternating(family))
    assert ours.config.layer_types == ["sliding_attention", "full_attention"] * 2
    layers = recomputable_layers(ours)
    assert len(layers) == 4
    windows = [state_of(layer).shape()["sliding_window"] for layer in layers]
    assert windows == [5, None, 5, None]
    ids, mask = batch(s=19)  # longer than the window: the sliding layers see less than the global ones
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
    assert_matches_reference(ref, plain, ours, input_ids=ids)


def test_gemma3_rope_bases_differ_per_layer_kind():
    """Both rope tables reach their layers: swapping the bases changes the converted model's logits as it
    changes the unconverted one's, and the converted model follows the float64 reference either way."""
    family = next(f for f in SANDWICH if f.name == "gemma3_text")
    ids, _ = batch(pad_rows=False)
    outs = []
    for local, full in ((10000.0, 1e6), (1e6, 10000.0)):
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": local},
                "full_attention": {"rope_type": "default", "rope_theta": full}}
        ref, plain, ours = triple(family.build(num_hidden_layers=4, sliding_window_pattern=2, rope_parameters=rope))
        assert_matches_reference(ref, plain, ours, input_ids=ids)
        with torch.no_grad():
            outs.append(ours(input_ids=ids).logits)
    assert not torch.allclose(outs[0], outs[1])


def _untouched(model, attn):
    return model.config._attn_implementation == attn and not any(PATCHED in vars(m) for m in model.modules())


@pytest.mark.parametrize("family", SANDWICH, ids=str)
@pytest.mark.parametrize("field, value", [("use_bidirectional_attention", True), ("attn_logit_softcapping", -1.0)])
def test_refusals_name_the_setting_and_change_nothing(family, field, value):
    model = family.build(**{field: value})()
    model.config._attn_implementation = "eager"
    with pytest.raises(ConversionError, match=field):
        convert(model)
    assert _untouched(model, "eager")
    assert not recomputable_layers(model)


def test_gemma2_released_defaults_convert_and_follow_float64():
    """Gemma2's defaults soft-cap the attention scores at 50 and the logits at 30: both convert, and the
    converted model follows the float64 reference (training loss and gradients, padded logits)."""
    family = SANDWICH[0]
    config = {k: v for k, v in family.tiny.items() if "softcapping" not in k}
    assert transformers.Gemma2Config(**config).attn_logit_softcapping == 50.0
    build = family.build(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    ref, plain, ours = triple(build)
    ids, mask = batch(s=19)
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
    ids, _ = batch(pad_rows=False)
    (r, rg), (p, pg), (o, og) = (_loss_and_grads(m, ids) for m in (ref, plain, ours))
    assert_within_rule(o, p, r, 2, name="loss")
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")


def test_attention_soft_capping_is_applied():
    """A cap that bends the scores moves Gemma2's converted logits, and the converted model follows float64
    with and without it (the cap reaches the kernels). Gemma3's attention ignores the config field."""
    family = SANDWICH[0]
    ids, mask = batch(s=19)
    outs = {}
    for cap in (None, 0.05):
        ref, plain, ours = triple(family.build(attn_logit_softcapping=cap))
        assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            outs[cap] = ours(input_ids=ids, attention_mask=mask).logits
    assert (outs[None] - outs[0.05]).abs().max() > 1e-3


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@sandwich
def test_final_logit_soft_capping_through_the_loss_head(family):
    """The training loss with final_logit_softcapping comes from the fused head (no logits) and follows the
    float64 reference as the unconverted model does; the cap changes the loss, so it is applied."""
    ids, _ = batch(pad_rows=False)
    losses = {}
    for cap in (None, 0.5):
        ref, plain, ours = triple(family.build(final_logit_softcapping=cap))
        (r, rg), (p, pg), (o, og) = (_loss_and_grads(m, ids) for m in (ref, plain, ours))
        assert ours(input_ids=ids, labels=ids).logits is None  # the fused head made no logits
        assert_within_rule(o, p, r, 2, name="loss")
        assert set(og) == set(rg)
        for n in rg:
            assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")
        losses[cap] = float(o)
    assert abs(losses[None] - losses[0.5]) > 1e-3


def test_gemma_norms_use_their_offset():
    """Non-zero (1 + w) norm weights (Gemma initialises them at 0): the offset reaches the kernels, q/k norms too."""
    for family in FAMILIES:
        def build(family=family):
            model = family.build()()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.copy_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p))
            return model
        ref, plain, ours = triple(build)
        ids, mask = batch()
        assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
