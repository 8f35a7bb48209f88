"""Gemma 4 specifics: non-trivial norm weights (w, not 1 + w) within the rule; what the converted text model does not
reproduce (per-layer input embeddings, kv-shared layers, bidirectional attention over all tokens) is refused naming
the setting before anything changes; in Gemma4ForConditionalGeneration the text model converts and the vision tower
and its embedder stay transformers' own, said once, and an image in the input is within the rule; the experts'
transformers default (grouped_mm) within the rule in float32 against eager's."""

import copy
import logging

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.models.patching import PATCHED
from selective_ckpt.registry import recomputable_layers
from tests.models.families import by_name
from tests.models.hf_checks import VOCAB, assert_matches_reference, batch, triple

transformers = pytest.importorskip("transformers")

TEXT = by_name("gemma4_text")


def _patched(module):
    return [n for n, m in module.named_modules() if PATCHED in vars(m)]


@pytest.mark.parametrize("setting, value, named", [
    ("hidden_size_per_layer_input", 16, "hidden_size_per_layer_input=16"),
    ("num_kv_shared_layers", 2, "num_kv_shared_layers=2"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention='all'"),
])
def test_unreproduced_settings_are_refused_before_any_change(setting, value, named):
    model = TEXT.build(**{setting: value})()
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ConversionError, match=named.replace("(", r"\(")):
        convert(model)
    assert model.config._attn_implementation == "sdpa" and not _patched(model)
    assert not recomputable_layers(model)


def test_vision_tower_stays_and_is_said(caplog):
    model = by_name("gemma4").build()()
    model.config._attn_implementation = "sdpa"
    with caplog.at_level(logging.INFO, logger="selective_ckpt"):
        convert(model)
    said = [r.getMessage() for r in caplog.records if "left as transformers' own" in r.getMessage()]
    assert len(said) == 1
    for name in ("model.vision_tower (Gemma4VisionModel)", "model.embed_vision (Gemma4MultimodalEmbedder)",
                 "lm_head (Linear)", "model.language_model (Gemma4TextModel)"):
        assert name in said[0], said[0]
    assert not _patched(model.model.vision_tower) and not _patched(model.model.embed_vision)
    assert _patched(model.model.language_model)
    assert len(recomputable_layers(model)) == 4
    assert model.config.text_config._attn_implementation == "selective_ckpt"
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_grouped_mm_experts_within_the_rule():
    """MoE layers on transformers' default experts (grouped_mm, which has no float64 kernel): the converted model
    against the unconverted one on grouped_mm in float32, both against the float64 reference on eager experts."""
    moe = by_name("gemma4_text_moe")
    ref, _, _ = triple(moe.build(num_hidden_layers=2))
    plain = copy.deepcopy(ref).float()
    plain.config._experts_implementation = "grouped_mm"
    plain.config._attn_implementation = "sdpa"
    ours = convert(copy.deepcopy(plain))
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)


def test_norm_weights_scale_as_w():
    """Non-trivial norm weights (Gemma 4 initialises them at 1 and scales by w, not 1 + w), the q/k norms' and the
    scale-free v norms beside them: within the rule against float64."""
    def build():
        model = TEXT.build()()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(torch.linspace(0.5, 1.5, p.numel()).view_as(p))
        return model

    ref, plain, ours = triple(build)
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)


def test_an_image_in_the_input_within_the_rule():
    """One image of 4 x 4 patches (pooled 2 x 2: four image tokens) in a text of 17 tokens: the vision tower's
    features scattered into the text by transformers, then the converted layers; logits and every gradient, the
    vision tower's included, within the rule against float64."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB - 3, (1, 17), generator=g)
    ids[0, 1:5] = VOCAB - 1  # the image token
    pixels = torch.randn(1, 16, 3 * 8 * 8, generator=g)  # patchified: 16 patches of 8 x 8 x 3
    positions = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
    ref, plain, ours = triple(by_name("gemma4").build())
    assert_matches_reference(ref, plain, ours, input_ids=ids, pixel_values=pixels, image_position_ids=positions)
    ours.zero_grad()
    ours(input_ids=ids, pixel_values=pixels, image_position_ids=positions, labels=ids).loss.backward()
    assert ours.model.vision_tower.patch_embedder.input_proj.weight.grad.abs().sum() > 0


def test_full_layers_with_their_own_kv_heads_are_estimated():
    """A config whose full layers have their own kv heads (num_global_key_value_heads, as Gemma 4's 31B and 26B-A4B
    have) is a per-layer config in transformers, which refuses a global num_key_value_heads: the estimate reads each
    layer's own heads. Full layers with k_eq_v keep k_proj's output once (v is its v-normed copy, rebuilt); the
    estimate counts a separate v projection output, t * Hkv * D bytes more than the layer keeps (on the safe side)."""
    from selective_ckpt.models.configuration import layer_estimate
    from tests.models.hf_checks import kept_bytes_per_layer

    kw = {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "global_head_dim": 16}
    ids, _ = batch(b=2, s=24, pad_rows=False)

    def layers(n):
        torch.manual_seed(0)
        return convert(TEXT.build(num_hidden_layers=n, layer_types=("full_attention",), **kw)().train())

    layer = recomputable_layers(layers(1))[0]
    assert layer.self_attn.k_proj.out_features == 16  # one kv head of the full layers' head dim
    measured = kept_bytes_per_layer(layers, {"input_ids": ids})
    assert layer_estimate(layer, ids.shape[1], ids.shape[0]) - measured == 2 * 24 * 1 * 16 * 4
