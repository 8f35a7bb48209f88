"""GLM-4, ERNIE 4.5 and Hunyuan dense beyond the shared family checks: the attention forward that shares the
interleaved rotary tables gives transformers' bits, and what a Hunyuan layer keeps (its q/k norms after RoPE) is
the estimate in every form that counts those norms differently ("none", bf16 autocast), counted by hand too."""

import pytest
import torch

from selective_ckpt import convert
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
