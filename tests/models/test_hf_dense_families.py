"""Phi-3, OLMo2 and SmolLM3 beyond the shared family checks: the packed projections' rebuild is exact and what
a layer keeps with dropout on is its estimate, OLMo2's norms are transformers' bits, layers without RoPE
ignore positions, and what cannot be converted is refused before anything changes."""

import copy

import pytest
import torch
from torch import nn

from selective_ckpt import ConversionError, convert
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers
from tests.models import hf_checks
from tests.models.families.dense import FAMILIES
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")
FAMILY = {f.name: f for f in FAMILIES}


@pytest.mark.parametrize("name", ["phi3", "olmo2", "smollm3"])
def test_modes_bit_identical_with_dropout(name):
    """none / selective / full: the same bits, so every rebuilt output (the packed halves' product, OLMo2's
    norms, the dropped residual-dropout outputs) is exactly what forward computed."""
    kw = dict(attention_dropout=0.17) | (dict(resid_pdrop=0.1) if name == "phi3" else {})
    _, _, ours = hf_checks.triple(FAMILY[name].build(**kw))
    ids, mask = hf_checks.batch()
    hf_checks.check_modes_identical(ours, ids, mask)


def test_phi3_with_dropout_keeps_its_estimate():
    """Residual and attention dropout on: each site keeps a seed, v is not kept as a view of the packed qkv."""
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)

    def layers(n):
        torch.manual_seed(0)
        model = FAMILY["phi3"].build(num_hidden_layers=n, resid_pdrop=0.1, attention_dropout=0.17)().train()
        model.config._attn_implementation = "sdpa"
        return convert(model)

    ours = hf_checks.kept_bytes_per_layer(layers, {"input_ids": ids})
    layer = recomputable_layers(layers(1))[0]
    parts = layer_estimate(layer, ids.shape[1], ids.shape[0], breakdown=True)
    assert parts["seeds"] == 3 * 8
    assert ours == sum(parts.values())


def test_phi3_packed_mlp_within_the_rule():
    """The converted Phi3MLP (gate and up the halves of the one gate_up_proj output, the product rebuilt from
    them) against transformers' Phi3MLP in float64, bf16: output and every gradient within the rule."""
    torch.manual_seed(0)
    model = FAMILY["phi3"].build()()
    ref = copy.deepcopy(model.model.layers[0].mlp).double()
    plain = copy.deepcopy(model.model.layers[0].mlp).to(torch.bfloat16)
    ours = convert(model.to(torch.bfloat16)).model.layers[0].mlp
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    results = []
    for m in (ours, plain, ref):
        xi = x.to(m.down_proj.weight.dtype).requires_grad_()
        y = m(xi)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
        results.append((y.detach(), xi.grad, m.gate_up_proj.weight.grad, m.down_proj.weight.grad))
    for i, (o, p, r) in enumerate(zip(*results)):
        assert_within_rule(o, p, r, 2 if i == 0 else 3, floor=1e-5, name=f"output {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_olmo2_norms_are_transformers_bits(dtype):
    """OLMo2's RMSNorm (scaled in float32, rounded once; also over the whole q/k projections) converted: the
    same output and gradients as its own forward, bit for bit."""
    torch.manual_seed(0)
    model = FAMILY["olmo2"].build()().to(dtype)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    plain = copy.deepcopy(attn.q_norm)
    convert(model)
    x = torch.randn(3, 5, 64, dtype=dtype)
    outs = []
    for m in (plain, attn.q_norm):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y))
        outs.append((y, xi.grad, m.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_smollm3_layers_without_rope_ignore_positions():
    """All layers without RoPE (and one with, against the float64 rule): shifting position_ids changes nothing
    only when no layer rotates."""
    ids, _ = hf_checks.batch(b=1, s=13)
    pos = torch.arange(13)[None]
    for no_rope, same in (([0, 0], True), ([0, 1], False)):
        ref, plain, ours = hf_checks.triple(FAMILY["smollm3"].build(no_rope_layers=no_rope, use_sliding_window=False))
        hf_checks.assert_matches_reference(ref, plain, ours, input_ids=ids, position_ids=pos)
        with torch.no_grad():
            a = ours(input_ids=ids, position_ids=pos).logits
            b = ours(input_ids=ids, position_ids=pos + 5).logits
        assert torch.equal(a, b) == same
    assert [m.self_attn.use_rope for m in recomputable_layers(ours)] == [0, 1]


class _Halve(nn.Module):
    def forward(self, x):
        return x * 0.5


def _unchanged(model):
    return not any("_selective_ckpt" in vars(m) or "_selective_ckpt_forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("name, tamper, words", [
    ("phi3", lambda m: setattr(m.model.layers[0].mlp, "activation_fn", _Halve()), "activation"),
    ("phi3", lambda m: setattr(m.model.layers[1], "extra", nn.Identity()), "extra"),
    ("phi3", lambda m: setattr(m.model.layers[0].resid_mlp_dropout, "inplace", True), "in-place"),
    ("olmo2", lambda m: setattr(m.model.layers[0], "post_feedforward_layernorm", nn.LayerNorm(64)),
     "post_feedforward_layernorm"),
    ("smollm3", lambda m: setattr(m.model.layers[1].self_attn, "rotary", nn.Identity()), "rotary"),
])
def test_refusals_change_nothing(name, tamper, words):
    model = FAMILY[name].build()()
    tamper(model)
    with pytest.raises(ConversionError, match=words):
        convert(model)
    assert _unchanged(model) and model.config._attn_implementation != "selective_ckpt"


def test_estimate_of_the_other_forms():
    """memory.estimate's post-norm, projection q/k norm and multiplier parts, counted by hand (fp32, t tokens,
    h 64, 4 heads of 16, 2 kv heads, ffn 112), and its refusals of bad values."""
    from selective_ckpt.memory import estimate

    t, h, kv = 48, 64, 32
    kw = dict(num_kv_heads=2, ffn_dim=112, norm="rmsnorm", activation="swiglu")
    llama = estimate(h, 4, 24, 2, torch.float32, **kw, breakdown=True)
    olmo2 = estimate(h, 4, 24, 2, torch.float32, **kw, residual="post-norm", qk_norm="projection", norm_stats=False,
                     breakdown=True)
    assert "norm_stats" not in olmo2
    assert olmo2["attn_out"] == olmo2["mlp_out"] == t * h * 4
    assert olmo2["qk_norm_in"] == t * (h + kv) * 4
    # q/k/v: v alone, the rotated q and k rebuilt from the norms' inputs (kept above): Llama's bytes in all, less
    # the norms' statistics, plus the post-norms' two inputs
    assert olmo2["qkv"] == t * kv * 4
    assert sum(olmo2.values()) == sum(llama.values()) - llama["norm_stats"] + t * 2 * h * 4
    none = estimate(h, 4, 24, 2, torch.float32, recompute="none", **kw, residual="post-norm", breakdown=True)
    assert "ln1_out" not in none and none["product"] == t * 112 * 4  # no post-norm output is saved by a consumer
    assert estimate(h, 4, 24, 2, torch.float32, **kw, scalar_multipliers=2) == sum(llama.values()) + 16
    for bad, error in ((dict(residual="sandwich"), ValueError), (dict(qk_norm="head"), ValueError),
                       (dict(norm_stats=1), TypeError), (dict(scalar_multipliers=-1), ValueError)):
        with pytest.raises(error, match=next(iter(bad))):
            estimate(h, 4, 24, 2, torch.float32, **kw, **bad)


class _Autocast(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        with torch.autocast("cpu", torch.bfloat16):
            return self.model(**kw)


@pytest.mark.parametrize("name", ["phi3", "olmo2", "smollm3"])
def test_kept_bytes_under_autocast_are_the_estimate(name):
    """fp32 weights under bf16 autocast (Trainer's bf16=True): OLMo2's projections read the fp32 residual
    stream directly, each keeping its own bf16 cast, which the estimate counts."""
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)

    def layers(n):
        torch.manual_seed(0)
        model = FAMILY[name].build(num_hidden_layers=n)().train()
        model.config._attn_implementation = "sdpa"
        return convert(model)

    ours = hf_checks.kept_bytes_per_layer(lambda n: _Autocast(layers(n)), {"input_ids": ids})
    layer = recomputable_layers(layers(1))[0]
    assert ours == layer_estimate(layer, ids.shape[1], ids.shape[0], autocast_dtype=torch.bfloat16)
