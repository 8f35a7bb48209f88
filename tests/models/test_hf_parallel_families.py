"""Starcoder2, Cohere and GPT-NeoX beyond the shared family checks: GPT-NeoX's parallel and sequential
residuals side by side, partial rotary, dropout by seed (bit-identical across recompute modes, a seed per
site and no mask kept), the loss head under Cohere's logit scale, and what convert() refuses."""

import copy

import pytest
import torch
from torch import nn

from selective_ckpt import ConversionError, convert
from selective_ckpt.memory import estimate
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.models.patching import PATCHED
from selective_ckpt.registry import recomputable_layers
from tests.models.families.parallel_and_layernorm import FAMILIES
from tests.models.hf_checks import (
    assert_matches_reference,
    assert_same_state,
    batch,
    check_modes_identical,
    check_window_applied,
    kept_bytes_per_layer,
    triple,
)

transformers = pytest.importorskip("transformers")

FAMILY = {str(f): f for f in FAMILIES}


def _kept(family, ids, **kw):
    """(bytes one converted layer keeps after a train-mode forward, its layer_estimate)."""
    def layers(n):
        torch.manual_seed(0)
        model = family.build(num_hidden_layers=n, **kw)().train()
        model.config._attn_implementation = "sdpa"
        return convert(model)

    layer = recomputable_layers(layers(1))[0]
    return kept_bytes_per_layer(layers, {"input_ids": ids}), layer_estimate(layer, ids.shape[1], ids.shape[0])


def test_neox_parallel_keeps_no_x1_and_sequential_does():
    """Same shape, both residual forms: each keeps its estimate, and the sequential layer keeps exactly x1
    (t*h fp32 elements) more; the parallel layer's estimate has two norms' statistics and no x1."""
    ids, _ = batch(b=2, s=24, pad_rows=False)
    par, par_est = _kept(FAMILY["gpt_neox"], ids)
    seq, seq_est = _kept(FAMILY["gpt_neox-sequential"], ids)
    assert (par, seq) == (par_est, seq_est)
    t, h = ids.numel(), 64
    assert seq - par == t * h * 4
    parts = estimate(64, 4, 24, 2, torch.float32, ffn_dim=112, residual="parallel", norms=2, breakdown=True)
    assert "x1" not in parts and parts["ln_stats"] == 2 * 2 * t * 4


def test_neox_residual_forms_compute_differently_and_right():
    """The converted parallel and sequential models (same weights) each follow their own float64 reference,
    and their outputs differ (the flag is honoured, not read as the other form)."""
    ids, mask = batch()
    outs = []
    for name in ("gpt_neox", "gpt_neox-sequential"):
        ref, plain, ours = triple(FAMILY[name].build())
        assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            outs.append(ours(input_ids=ids).logits)
    assert not torch.allclose(outs[0], outs[1])


@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
def test_neox_partial_rotary(rotary_pct):
    """Rotary on a quarter of each head (the pass-through dims untouched) and on all of it, within the rule."""
    ref, plain, ours = triple(FAMILY["gpt_neox"].build(rotary_pct=rotary_pct))
    assert ours.gpt_neox.layers[0].attention.rotary_ndims == int(16 * rotary_pct)
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)


_DROPOUT = {
    "starcoder2": dict(residual_dropout=0.17, embedding_dropout=0.1, attention_dropout=0.1),
    "gpt_neox": dict(hidden_dropout=0.17, attention_dropout=0.1),
}


@pytest.mark.parametrize("name", sorted(_DROPOUT))
def test_dropout_by_seed_modes_bit_identical(name):
    """With every dropout on: "none", "selective", "full" and gradient_checkpointing_enable give the same bits,
    and the dropouts act (train output differs from eval)."""
    torch.manual_seed(0)
    model = convert(FAMILY[name].build(**_DROPOUT[name])().train())
    ids, mask = batch()
    check_modes_identical(model, ids, mask)
    with torch.no_grad():
        torch.manual_seed(1)
        train = model(input_ids=ids).logits
        model.eval()
        evaluated = model(input_ids=ids).logits
    assert not torch.allclose(train, evaluated)


@pytest.mark.parametrize("name", sorted(_DROPOUT))
def test_dropout_keeps_seeds_not_masks(name):
    """With the dropouts on, a layer keeps its estimate: one 8-byte seed per site (attention probabilities,
    attention output, MLP output), no mask."""
    ids, _ = batch(b=2, s=24, pad_rows=False)
    kept, est = _kept(FAMILY[name], ids, **_DROPOUT[name])
    assert kept == est
    no_dropout = {k: 0.0 for k in _DROPOUT[name]}
    assert kept - _kept(FAMILY[name], ids, **no_dropout)[0] == 3 * 8


def test_starcoder2_dropout_follows_its_seeds():
    """Starcoder2's functional dropouts draw from torch's generator like every converted dropout: the same
    seed gives the same train-mode output, another seed another one; the rates are restored after the call."""
    torch.manual_seed(0)
    model = convert(FAMILY["starcoder2"].build(**_DROPOUT["starcoder2"])().train())
    ids, _ = batch()
    outs = []
    for seed in (4, 4, 5):
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(model(input_ids=ids).logits)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert model.model.embedding_dropout == 0.1
    assert all(layer.self_attn.residual_dropout == 0.17 for layer in model.model.layers)


def test_cohere_loss_head_under_the_logit_scale():
    """Train mode with labels: the fused head gives the unconverted loss (scale 0.5 folded in) and no logits;
    gradients of every parameter follow the unconverted ones."""
    torch.manual_seed(0)
    plain = FAMILY["cohere"].build()().train()
    plain.config._attn_implementation = "sdpa"
    ours = convert(copy.deepcopy(plain))
    ids, _ = batch(pad_rows=False)
    out_p, out_o = plain(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert out_o.logits is None
    torch.testing.assert_close(out_o.loss, out_p.loss, rtol=1e-5, atol=1e-6)
    out_p.loss.backward()
    out_o.loss.backward()
    grads = dict(ours.named_parameters())
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n].grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_cohere_one_norm_for_both_branches():
    """A Cohere layer keeps x and one norm's statistics: its estimate has no x1, one LayerNorm's mean and rstd."""
    model = convert(FAMILY["cohere"].build()())
    layer = recomputable_layers(model)[0]
    parts = layer_estimate(layer, 10, 1, breakdown=True)
    assert "x1" not in parts and parts["ln_stats"] == 2 * 10 * 4


def _unchanged(model, before):
    assert_same_state(model, before)
    assert not any(hasattr(m, PATCHED) for m in model.modules())


def test_refuses_cohere_qk_norm():
    model = FAMILY["cohere"].build(use_qk_norm=True)()
    before = copy.deepcopy(model)
    with pytest.raises(ConversionError, match="use_qk_norm"):
        convert(model)
    _unchanged(model, before)


def test_refuses_inplace_neox_dropout():
    model = FAMILY["gpt_neox"].build(hidden_dropout=0.1)()
    model.gpt_neox.layers[1].post_mlp_dropout.inplace = True
    before = copy.deepcopy(model)
    with pytest.raises(ConversionError, match="in-place nn.Dropout"):
        convert(model)
    _unchanged(model, before)


@pytest.mark.parametrize("name, where", [("starcoder2", "model.layers.0.mlp.act"),
                                         ("gpt_neox", "gpt_neox.layers.0.mlp.act")])
def test_refuses_an_activation_it_cannot_rebuild(name, where):
    model = FAMILY[name].build()()
    parent, _, child = where.rpartition(".")
    setattr(model.get_submodule(parent), child, nn.Softmax(dim=-1))
    before = copy.deepcopy(model)
    with pytest.raises(ConversionError, match="Softmax"):
        convert(model)
    _unchanged(model, before)


def test_refuses_an_extra_module_in_a_neox_layer():
    model = FAMILY["gpt_neox"].build()()
    model.gpt_neox.layers[0].adapter = nn.Linear(64, 64)
    with pytest.raises(ConversionError, match="adapter"):
        convert(model)


@pytest.mark.parametrize("kw, word", [(dict(residual="sideways"), "residual"), (dict(norms=3), "norms"),
                                      (dict(norms=1), "norms"), (dict(residual="parallel", norms=True), "norms")])
def test_estimate_names_a_bad_residual_argument(kw, word):
    with pytest.raises(ValueError, match=word):
        estimate(64, 4, 8, 1, torch.float32, **kw)


def test_starcoder2_window_is_applied():
    """A window shorter than the sequence: the first token reaches positions past the window only through
    earlier layers (one layer: not at all)."""
    check_window_applied(FAMILY["starcoder2"].build(num_hidden_layers=1))


def test_starcoder2_embedding_dropout_keeps_a_seed():
    """The model-level embedding dropout keeps 8 bytes of seed where transformers' keeps a mask of the embeddings."""
    from selective_ckpt.memory.peak import cpu_allocation_deltas

    ids, _ = batch(b=2, s=24, pad_rows=False)

    def kept(p, converted):
        torch.manual_seed(0)
        model = FAMILY["starcoder2"].build(num_hidden_layers=1, embedding_dropout=p)().train()
        model.config._attn_implementation = "sdpa"
        model = convert(model) if converted else model
        held = []
        return sum(cpu_allocation_deltas(lambda: held.append(model(input_ids=ids).logits)))

    assert kept(0.1, True) - kept(0.0, True) == 8
    assert kept(0.1, False) - kept(0.0, False) >= ids.numel() * 64
