"""GLM-4, ERNIE 4.5, Hunyuan dense and GLM-4.5 (glm4_moe) beyond the shared family checks: the attention forward
that shares the interleaved rotary tables gives transformers' bits; what a Hunyuan layer keeps (its q/k norms after
RoPE) is the estimate in every form that counts those norms differently ("none", bf16 autocast), counted by hand
too; GLM-4.5's dense layers before first_k_dense_replace, its optional q/k norms, its ungated shared experts in the
estimate, and a block whose shared experts are not its MLP refused before anything changes."""

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.memory import LayerShape, MoE
from selective_ckpt.memory.parts import Attention
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.models.patching import PATCHED
from selective_ckpt.registry import recomputable_layers
from tests.models import hf_checks
from tests.models.families import by_name

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["glm4", "ernie4_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rope_attention_is_transformers_bits(name, dtype):
    """The patched attention forward against the module's own, on SDPA, with padded positions per row: the same
    output and the same input gradient, bit for bit."""
    torch.manual_seed(0)
    model = by_name(name).build()().to(dtype).train()
    model.config._attn_implementation = "sdpa"
    convert(model)
    model.config._attn_implementation = "sdpa"
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 11, 64, dtype=dtype)
    pos = torch.stack([torch.arange(11), torch.arange(11) + 3])
    emb = model.model.rotary_emb(x, pos)
    results = []
    for forward in (getattr(attn, PATCHED), attn.forward):
        xi = x.clone().requires_grad_()
        out, _ = forward(hidden_states=xi, position_embeddings=emb, attention_mask=None)
        out.sum().backward()
        results.append((out, xi.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _hunyuan_layers(**kw):
    def layers(n):
        torch.manual_seed(0)
        model = by_name("hunyuan_v1_dense").build(num_hidden_layers=n)().train()
        model.config._attn_implementation = "sdpa"
        return convert(model, **kw)
    return layers


class _Autocast(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        with torch.autocast("cpu", torch.bfloat16):
            return self.model(**kw)


@pytest.mark.parametrize("form", ["none", "bf16 autocast"])
def test_hunyuan_keeps_its_estimate(form):
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)
    layers = _hunyuan_layers(recompute="none" if form == "none" else "selective")
    wrap = _Autocast if form == "bf16 autocast" else (lambda m: m)
    ours = hf_checks.kept_bytes_per_layer(lambda n: wrap(layers(n)), {"input_ids": ids})
    layer = recomputable_layers(layers(1))[0]
    autocast = torch.bfloat16 if form == "bf16 autocast" else None
    assert ours == layer_estimate(layer, ids.shape[1], ids.shape[0], autocast_dtype=autocast)


def test_estimate_of_rotated_qk_norms():
    """qk_norm="rotated" by hand (fp32, t tokens, h 64, 4 heads of 16, 2 kv heads): Llama's floor plus an fp32
    rstd per head and token; under "none" the norms' outputs too."""
    from selective_ckpt.memory import estimate

    t, heads = 48, 4 + 2
    kw = dict(num_kv_heads=2, ffn_dim=112, norm="rmsnorm", activation="swiglu")
    for mode, extra in (("selective", t * heads * 4), ("none", t * heads * 4 + t * heads * 16 * 4)):
        llama = estimate(64, 4, 24, 2, torch.float32, recompute=mode, **kw)
        assert estimate(64, 4, 24, 2, torch.float32, recompute=mode, qk_norm="rotated", **kw) == llama + extra


def test_glm4_moe_dense_layers_before_first_k_dense_replace():
    ref, plain, ours = hf_checks.triple(by_name("glm4_moe").build(first_k_dense_replace=1))
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["Glm4MoeMLP", "Glm4MoeMoE"]
    ids, mask = hf_checks.batch()
    hf_checks.assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)
    assert [LayerShape(**layer._selective_ckpt.shape()).part(MoE) is not None
            for layer in recomputable_layers(ours)] == [False, True]


@pytest.mark.parametrize("mode", ["selective", "none"])
def test_glm4_moe_with_qk_norms_keeps_its_estimate(mode):
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)

    def layers(n):
        torch.manual_seed(0)
        model = by_name("glm4_moe").build(num_hidden_layers=n, use_qk_norm=True)().train()
        model.config._attn_implementation = "sdpa"
        return convert(model, recompute=mode)

    ours = hf_checks.kept_bytes_per_layer(layers, {"input_ids": ids})
    layer = recomputable_layers(layers(1))[0]
    assert LayerShape(**layer._selective_ckpt.shape()).part(Attention).qk_norm is True
    assert ours == layer_estimate(layer, ids.shape[1], ids.shape[0])


def test_moe_estimate_of_ungated_shared_experts():
    """A shared expert added without a sigmoid gate keeps its gate and up outputs ("none": its product too), no
    sigmoid output and no scaled product."""
    from selective_ckpt.memory import MoE

    gated, ungated = (MoE(num_experts=8, top_k=2, expert_dim=32, shared_dim=48, shared_gate=g) for g in (True, False))
    for mode in ("selective", "none"):
        a, b = gated.kept(10, 4, 4, mode), ungated.kept(10, 4, 4, mode)
        assert a.pop("shared_sigmoid") == 10 * 4 and "shared_sigmoid" not in b
        if mode == "none":
            assert a.pop("shared_scaled") == 10 * 48 * 4 and b["shared_product"] == 10 * 48 * 4
        assert a == b


def test_glm4_moe_shared_experts_not_its_mlp_are_refused():
    model = by_name("glm4_moe").build()()
    model.model.layers[1].mlp.shared_experts = torch.nn.Linear(64, 64)
    before = {n: type(m.forward) for n, m in model.named_modules()}
    with pytest.raises(ConversionError, match="shared_experts"):
        convert(model)
    assert {n: type(m.forward) for n, m in model.named_modules()} == before
    assert model.config._attn_implementation != "selective_ckpt"
