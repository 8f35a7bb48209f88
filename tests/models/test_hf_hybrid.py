"""Hybrid families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) beyond the shared family checks: the Gated DeltaNet runs
transformers' torch fallback on CPU and stays transformers' own, convert says once which layers keep it, each
layer kind's kept bytes are measured against transformers' SDPA layer and the estimate (printed), and what cannot
be converted is refused before anything changes."""

import copy
import logging

import pytest
import torch
from torch import nn

from selective_ckpt import ConversionError, convert, keeping, set_recompute
from selective_ckpt.memory import ledger
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.models.patching import PATCHED
from selective_ckpt.registry import recomputable_layers
from tests.models import hf_checks
from tests.models.families.hybrid import FAMILIES

transformers = pytest.importorskip("transformers")
FAMILY = {f.name: f for f in FAMILIES}


def test_deltanet_runs_the_torch_fallback_on_cpu_and_stays_transformers(monkeypatch):
    """No fla or causal-conv1d kernels here: the converted linear-attention layers call transformers' torch
    chunked delta rule and convolution (the module's own forward, not a patched one), and the model's logits and
    gradients follow the float64 reference."""
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    calls = []
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        original = getattr(modeling, name)
        monkeypatch.setattr(modeling, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    ref, plain, ours = hf_checks.triple(FAMILY["qwen3_next"].build())
    mixers = [layer.linear_attn for layer in ours.model.layers if hasattr(layer, "linear_attn")]
    assert len(mixers) == 2 and not any(PATCHED in vars(m) for m in mixers)
    ids, mask = hf_checks.batch(pad_rows=False)
    calls.clear()
    hf_checks.assert_matches_reference(ref, plain, ours, input_ids=ids)
    # two linear-attention layers in each of the three models' forwards
    assert calls.count("torch_chunk_gated_delta_rule") == 6 and calls.count("causal_conv1d_fn") == 6


def test_convert_says_once_which_layers_keep_their_mixer(caplog):
    torch.manual_seed(0)
    model = FAMILY["qwen3_next"].build()()
    with caplog.at_level(logging.INFO, logger="selective_ckpt"):
        convert(model)
    said = [r.getMessage() for r in caplog.records if "linear_attn" in r.getMessage()]
    assert len(said) == 1
    assert "decoder layers 0, 2 of 4" in said[0] and "Qwen3NextGatedDeltaNet" in said[0]
    assert "what it saves for backward" in said[0] and "no kernel" in said[0]


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_kept_bytes_per_layer_kind(family, record_property):
    """Each layer kind alone (2 layers minus 1, train mode, no kv cache): what a converted layer keeps equals the
    estimate (the linear-attention layer's DeltaNet counted by its fake run), is less than transformers' SDPA
    layer keeps, and the ledger counts the DeltaNet's saved tensors apart. Printed per kind."""
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)
    inputs = {"input_ids": ids, "use_cache": False}
    lines = []
    for kind, kw in family.layer_kinds:
        def layers(n, converted=True):
            torch.manual_seed(0)
            model = family.build(num_hidden_layers=n, **kw)().train()
            model.config._attn_implementation = "sdpa"
            return convert(model) if converted else model

        ours = hf_checks.kept_bytes_per_layer(layers, inputs)
        theirs = hf_checks.kept_bytes_per_layer(lambda n: layers(n, False), inputs)
        model = layers(1)
        parts = layer_estimate(recomputable_layers(model)[0], ids.shape[1], ids.shape[0], breakdown=True)
        assert ours == sum(parts.values()), kind
        assert ours < theirs, kind
        mixer = parts.get("mixer", 0)
        assert (mixer > 0) == (kind == "linear_attention")
        if mixer:  # the ledger counts what the DeltaNet saved, also the branch its output does not reach
            assert ledger(model, **inputs).mixer_bytes["model.layers.0"] >= mixer
        lines.append(f"{family.name} {kind}: ours {ours} B (DeltaNet's own {mixer} B), transformers SDPA {theirs} B, "
                     f"{ours / theirs:.2f}x")
        record_property(kind, f"{ours} / {theirs}")
    print("\nkept bytes per layer, batch 2 x 24 tokens, fp32:\n  " + "\n  ".join(lines))


def _untouched(model):
    return model.config._attn_implementation == "sdpa" and not any(PATCHED in vars(m) for m in model.modules())


def test_refused_before_anything_changes():
    family = FAMILY["qwen3_next"]
    torch.manual_seed(0)
    model = family.build(mlp_only_layers=[0, 1, 2, 3])()  # dense MLPs: layer tiles refuse mixtures of experts anyway
    model.config._attn_implementation = "sdpa"
    # a q_proj without the gate half
    bad = copy.deepcopy(model)
    bad.model.layers[1].self_attn.q_proj = nn.Linear(64, 64, bias=False)
    with pytest.raises(ConversionError, match="q_proj gives 64 features"):
        convert(bad)
    assert _untouched(bad)
    # a layer holding neither token mixer
    bad = copy.deepcopy(model)
    del bad.model.layers[0].linear_attn
    with pytest.raises(ConversionError, match="holds none of its token mixers"):
        convert(bad)
    assert _untouched(bad)
    # layer tiles would start the DeltaNet's recurrence anew in every tile
    bad = copy.deepcopy(model)
    with pytest.raises(ConversionError, match="query tiles"):
        convert(bad, recompute=keeping.policy("full", layer_tiles=2))
    assert _untouched(bad)
    ours = convert(copy.deepcopy(model))
    with pytest.raises(ValueError, match="recurrent"):
        set_recompute(ours, keeping.policy("full", layer_tiles=2))


def test_packed_documents_as_transformers_packs_them():
    """position_ids restarting per document, no attention_mask: the full-attention layers keep documents apart
    (checked alone), and the hybrid follows the float64 reference, whose DeltaNet (transformers' torch fallback)
    runs its recurrence across document starts, converted or not."""
    family = FAMILY["qwen3_next"]
    ids, _ = hf_checks.batch(b=1, s=23)
    pos = torch.tensor([list(range(9)) + list(range(5)) + list(range(9))])
    packed = dict(input_ids=ids, position_ids=pos, use_cache=False)
    ref, plain, ours = hf_checks.triple(family.build())
    hf_checks.assert_matches_reference(ref, plain, ours, **packed)
    ref, plain, ours = hf_checks.triple(family.build(full_attention_interval=1))
    hf_checks.assert_matches_reference(ref, plain, ours, **packed)
    other = ids.clone()
    other[:, :9] = (other[:, :9] + 1) % hf_checks.VOCAB
    with torch.no_grad():
        whole = ours(**packed).logits
        changed = ours(input_ids=other, position_ids=pos, use_cache=False).logits
    # within rounding: the experts' matmuls take other row counts when the first document changes
    torch.testing.assert_close(whole[:, 9:], changed[:, 9:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(whole[:, :9], changed[:, :9], rtol=1e-3, atol=1e-3)
