"""Composite models whose text decoder converts (hf.ModelSpec.text_model; the shared checks run them through
tests/models/families/composite.py): Mistral 3's vision tower and projector stay transformers' own and are said
once; an image in the input is within the rule against float64; the base model (no head) converts its text model;
a text model of another kind is refused naming it; fit and plan, which read a causal LM's config, refuse a
composite's config and accept its text_config."""

import copy
import logging

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.models.patching import PATCHED
from selective_ckpt.registry import recomputable_layers
from tests.models.families import by_name
from tests.models.hf_checks import VOCAB, assert_matches_reference, assert_same_state, batch, triple
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")

FAMILY = by_name("mistral3")


def _patched(module):
    return [n for n, m in module.named_modules() if PATCHED in vars(m)]


def _image_batch():
    """One 32 x 32 image (4 x 4 patches, merged 2 x 2: four image tokens) at the start of a text of 13 tokens."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB - 1, (1, 17), generator=g)
    ids[0, :4] = VOCAB - 1  # the image token
    return ids, torch.randn(1, 3, 32, 32, generator=g), torch.tensor([[32, 32]])


def test_vision_tower_and_projector_stay_and_are_said(caplog):
    model = FAMILY.build()()
    model.config._attn_implementation = "sdpa"
    with caplog.at_level(logging.INFO, logger="selective_ckpt"):
        convert(model)
    said = [r.getMessage() for r in caplog.records if "left as transformers' own" in r.getMessage()]
    assert len(said) == 1
    for name in ("model.vision_tower (PixtralVisionModel)", "model.multi_modal_projector "
                 "(Mistral3MultiModalProjector)", "lm_head (Linear)", "model.language_model (MistralModel)"):
        assert name in said[0], said[0]
    assert not _patched(model.model.vision_tower) and not _patched(model.model.multi_modal_projector)
    assert _patched(model.model.language_model)
    assert len(recomputable_layers(model)) == 2
    config = model.config
    assert config.text_config._attn_implementation == "selective_ckpt"
    assert config.vision_config._attn_implementation == "sdpa"


def test_an_image_in_the_input_within_the_rule():
    """The vision tower's features scattered into the text (transformers' own path), then the converted layers:
    logits and every gradient, the vision tower's and projector's included, within the rule against float64."""
    ref, plain, ours = triple(FAMILY.build())
    ids, pixels, sizes = _image_batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, pixel_values=pixels, image_sizes=sizes)
    ours.zero_grad()
    ours(input_ids=ids, pixel_values=pixels, image_sizes=sizes, labels=ids).loss.backward()
    assert ours.model.vision_tower.patch_conv.weight.grad.abs().sum() > 0


def test_base_model_converts_its_text_model():
    """Mistral3Model (no head) holds its text model at "language_model": converted there, hidden states and every
    gradient within the rule against float64."""
    ref, plain, ours = triple(lambda: transformers.Mistral3Model(FAMILY.build()().config))
    assert len(recomputable_layers(ours)) == 2 and not _patched(ours.vision_tower)
    ids, mask = batch()
    weights = torch.linspace(-1, 1, FAMILY.tiny["hidden_size"], dtype=torch.float64)
    outs, grads = [], []
    for model in (ref, plain, ours):
        model.zero_grad(set_to_none=True)
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        (h.double() * weights).sum().backward()
        outs.append(h.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert_within_rule(outs[2], outs[1], outs[0], 2, name="hidden states")
    assert set(grads[2]) == set(grads[1]) == set(grads[0])
    for n in grads[0]:
        assert_within_rule(grads[2][n], grads[1][n], grads[0][n], 3, floor=1e-5, name=f"grad {n}")


def test_another_text_model_is_refused_naming_it():
    config = transformers.Mistral3Config(
        text_config=transformers.LlamaConfig(**FAMILY.tiny), **dict(FAMILY.composite))
    model = transformers.Mistral3ForConditionalGeneration(config)
    before = copy.deepcopy(model)
    with pytest.raises(ConversionError, match=r"model\.language_model \(LlamaModel.*text model type 'llama'.*"
                                              r"MistralDecoderLayer"):
        convert(model)
    assert_same_state(model, before)
    assert not _patched(model) and model.config.text_config._attn_implementation != "selective_ckpt"


def test_fit_and_plan_refuse_the_composite_config_and_take_its_text_config():
    """fit and plan read a causal LM's config (AutoModelForCausalLM): a Mistral3Config, whose sizes are in its
    text_config, is a ValueError pointing at its text_config; its text_config projects the text model
    (the vision tower's and projector's weights not counted)."""
    from selective_ckpt import fit

    config = FAMILY.build()().config
    with pytest.raises(ValueError, match="pass config.text_config"):
        fit.fit(config, 80e9, seq_len=16)
    with pytest.raises(TypeError, match="causal LM"):
        fit.plan(FAMILY.build()(), 80e9, seq_len=16)
    got = fit.predict(config.text_config, 1, 16, fit.TrainingForm("full"), names=("ours selective",))
    assert got["ours selective"].error is None and got["ours selective"].peak > 0
