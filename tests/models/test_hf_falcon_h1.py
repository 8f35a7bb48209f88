"""Falcon-H1 (models/falcon_h1.py): the Mamba-2 mixer beside the attention in every layer. The shared family checks
run from tests/models/families/falcon_h1.py; here what is Falcon-H1's own: the kept bytes per layer against
transformers' SDPA layer with the mixer counted apart, the mixer's torch fallback on CPU, and the refusals (a layer
without its mixer or MuP vector, layer tiles)."""

import copy
import logging

import pytest
import torch

from selective_ckpt import ConversionError, convert, keeping, set_recompute
from selective_ckpt.memory import ledger
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.models.patching import PATCHED
from selective_ckpt.registry import recomputable_layers
from tests.models import hf_checks
from tests.models.families import by_name

transformers = pytest.importorskip("transformers")
FAMILY = by_name("falcon_h1")


def test_kept_bytes_per_layer(record_property):
    """A converted layer (2 layers minus 1, train mode) keeps exactly its estimate, attention's parts and the
    mixer's own bytes both in it, less than transformers' SDPA layer; the ledger counts the mixer's apart."""
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)
    inputs = {"input_ids": ids, "use_cache": False}

    def layers(n, converted=True):
        torch.manual_seed(0)
        model = FAMILY.build(num_hidden_layers=n)().train()
        model.config._attn_implementation = "sdpa"
        return convert(model) if converted else model

    ours = hf_checks.kept_bytes_per_layer(layers, inputs)
    theirs = hf_checks.kept_bytes_per_layer(lambda n: layers(n, False), inputs)
    model = layers(1)
    parts = layer_estimate(recomputable_layers(model)[0], ids.shape[1], ids.shape[0], breakdown=True)
    assert ours == sum(parts.values())
    assert ours < theirs
    assert parts["mixer"] > 0 and parts["qkv"] > 0 and parts["lse"] > 0 and parts["attn_in"] > 0
    assert ledger(model, **inputs).mixer_bytes["model.layers.0"] >= parts["mixer"]
    record_property("kept", f"{ours} / {theirs}")
    print(f"\nfalcon_h1 kept bytes per layer, 2 x 24 tokens, fp32: ours {ours} B (the Mamba-2 mixer's own "
          f"{parts['mixer']} B), transformers SDPA {theirs} B, {ours / theirs:.2f}x")


def test_mixer_runs_its_torch_fallback_on_cpu(caplog):
    """Without mamba_ssm / causal-conv1d on CPU the kept mixer runs transformers' torch fallback, forward and
    backward, and convert says once which layers keep it."""
    torch.manual_seed(0)
    model = FAMILY.build()()
    with caplog.at_level(logging.INFO, logger="selective_ckpt"):
        convert(model)
    said = [r.getMessage() for r in caplog.records if "FalconH1Mixer" in r.getMessage()]
    assert len(said) == 1 and "decoder layers 0, 1 of 2 keep their mamba" in said[0]
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)
    model.train()(input_ids=ids, labels=ids).loss.backward()
    grads = [layer.mamba.in_proj.weight.grad for layer in model.model.layers]
    assert all(g is not None and g.isfinite().all() and g.abs().sum() > 0 for g in grads)


def _untouched(model):
    return not any(PATCHED in vars(m) for m in model.modules())


def test_refused_before_anything_changes():
    torch.manual_seed(0)
    model = FAMILY.build()()
    bad = copy.deepcopy(model)
    del bad.model.layers[1].mamba  # a layer holding its attention alone
    with pytest.raises(ConversionError, match="holds both"):
        convert(bad)
    assert _untouched(bad)
    bad = copy.deepcopy(model)
    del bad.model.layers[0].mamba.mup_vector
    with pytest.raises(ConversionError, match="no mup_vector"):
        convert(bad)
    assert _untouched(bad)
    # layer tiles would start the Mamba-2 scan anew in every tile
    bad = copy.deepcopy(model)
    with pytest.raises(ConversionError, match="query tiles"):
        convert(bad, recompute=keeping.policy("full", layer_tiles=2))
    assert _untouched(bad)
    ours = convert(copy.deepcopy(model))
    with pytest.raises(ValueError, match="recurrent"):
        set_recompute(ours, keeping.policy("full", layer_tiles=2))
