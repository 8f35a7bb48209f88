"""DeepSeek-V3 beyond the shared family checks (tests/models/families/moe.py): what a latent-attention layer keeps is
the estimate in every recompute mode, counted by hand too (docs/kernels/mla.md: the four matmul outputs, no copy of
v, the rebuilt query and key); a forward with earlier keys in the cache and gradients follows transformers; a kv-head count other than the head count is refused before
anything changes."""

import warnings

import pytest
import torch

from selective_ckpt import ConversionError, convert
from selective_ckpt.memory import MLA, estimate, ledger
from selective_ckpt.memory.parts import DenseMLP, Residual
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers
from tests.models import hf_checks
from tests.models.families import by_name

transformers = pytest.importorskip("transformers")

FAMILY = by_name("deepseek_v3")


def _layers(mode, **kw):
    def build(n):
        torch.manual_seed(0)
        model = FAMILY.build(num_hidden_layers=n, **kw)().train()
        model.config._attn_implementation = "sdpa"
        return convert(model, recompute=mode)
    return build


@pytest.mark.parametrize("mode", ["none", "full", "attention-kept"])
def test_layer_keeps_its_estimate_in_every_mode(mode):
    """"none" as the family checks measure "selective" (a 2-layer model less a 1-layer one); "full" and
    "attention-kept" by the ledger's bytes of the second layer (a model's difference there also holds a copy of the
    generator's state per checkpoint, which the estimate leaves out)."""
    ids, _ = hf_checks.batch(b=2, s=24, pad_rows=False)
    build = _layers(mode)
    estimated = layer_estimate(recomputable_layers(build(1))[0], ids.shape[1], ids.shape[0])
    if mode == "none":
        assert hf_checks.kept_bytes_per_layer(build, {"input_ids": ids}) == estimated
    else:
        model = build(2)
        report = ledger(lambda: model(input_ids=ids, labels=ids).loss)
        assert report.by_layer["DeepseekV3DecoderLayer#1"] == estimated


def test_attention_keeps_the_projections_not_the_query_and_key():
    """By hand, float32, 48 tokens: the attention's q/k/v class is the four matmul outputs (q_a 40, q_b 4 x 24,
    kv_a 24 + 8, kv_b 4 x (16 + 12)), o 4 x 12; the rebuilt query and key (4 x 24 each) and a copy of v are not
    kept."""
    mla = MLA(heads=4, nope=16, rope=8, value=12, kv_rank=24, q_rank=40)
    t = 48
    parts = estimate(64, 4, 24, 2, torch.float32, mlp_ratio=0.5, norm="rmsnorm", activation="swiglu",
                     num_kv_heads=4, parts=(Residual(), mla, DenseMLP(gated=True)), breakdown=True)
    assert parts["qkv"] == t * (40 + 96 + 32 + 112) * 4 and parts["o"] == t * 48 * 4
    assert parts["latent_norm_stats"] == 2 * t * 4
    none = estimate(64, 4, 24, 2, torch.float32, mlp_ratio=0.5, norm="rmsnorm", activation="swiglu",
                    num_kv_heads=4, parts=(Residual(), mla, DenseMLP(gated=True)), recompute="none",
                    breakdown=True)
    assert none["mla_qk"] == t * (2 * 96 + 8) * 4 and none["latent_norm_out"] == t * (40 + 24) * 4
    assert MLA(heads=4, nope=16, rope=8, value=12, kv_rank=24).kept(t, 4, 4)["qkv"] == t * (96 + 32 + 112) * 4


def test_a_cache_with_earlier_keys_and_gradients_follows_transformers():
    """Queries against a cache holding earlier tokens (Sq != Sk) with gradients on: transformers' SDPA for that
    call, the latent and rotated key the cache hands back."""
    ref, plain, ours = hf_checks.triple(FAMILY.build())
    ids, _ = hf_checks.batch(b=2, s=19, pad_rows=False)
    outs = []
    for model in (ref, plain, ours):
        model.eval()
        with torch.no_grad():
            cache = model(input_ids=ids[:, :11], use_cache=True).cache
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ours says once that such a call keeps what SDPA keeps
            outs.append(model(input_ids=ids[:, 11:], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(outs[2], outs[1], rtol=1e-5, atol=1e-5)
    assert (outs[2].double() - outs[0]).abs().max() <= 2 * (outs[1].double() - outs[0]).abs().max() + 1e-6


def test_kv_heads_other_than_heads_are_refused_before_anything_changes():
    model = FAMILY.build()()
    model.config.num_key_value_heads = 2
    before = {n: type(m.forward) for n, m in model.named_modules()}
    with pytest.raises(ConversionError, match="num_key_value_heads=2"):
        convert(model)
    assert {n: type(m.forward) for n, m in model.named_modules()} == before
    assert model.config._attn_implementation != "selective_ckpt"
