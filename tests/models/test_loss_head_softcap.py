"""Final-logit soft-capping in the converted causal LM's loss head: LogitSteps reading transformers'
`logits / cap -> tanh -> logits * cap` (with scales around it) as the fused head's softcap, refusing
what it cannot reproduce; the capped loss of a plain head (bf16) and of a LoRA head (chunked module
path) against float64, as the unconverted model computes it."""

import copy

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models.loss_head import LogitSteps
from tests.models.families.gemma import FAMILIES
from tests.models.hf_checks import batch, reference_attention, unconverted_attention
from tests.reference import assert_within_rule, max_err

transformers = pytest.importorskip("transformers")

GEMMA2 = next(f for f in FAMILIES if f.name == "gemma2")


def _steps():
    return LogitSteps.wrap(torch.empty(()).expand(3, 5), None, ())


@pytest.mark.parametrize("pre, cap, factor", [(1.0, 30.0, 1.0), (2.0, 30.0, 2.0), (0.25, 5.0, 0.25)])
def test_scales_around_one_tanh_become_a_softcap(pre, cap, factor):
    z = _steps() * pre / cap
    z = torch.tanh(z) * cap
    got_factor, got_cap = z.scale_and_softcap()
    assert got_cap == cap
    assert got_factor == pytest.approx(factor, rel=1e-15)


def test_tensor_method_tanh_and_scale_after():
    z = (_steps() / 4.0).tanh() * 4.0 * 0.5  # 2 tanh(z / 4) = 2 tanh((0.5 z) / 2): cap 2, factor 0.5
    factor, cap = z.scale_and_softcap()
    assert cap == 2.0 and factor == pytest.approx(0.5)


def test_no_tanh_is_a_plain_scale():
    assert (_steps() / 4.0).scale_and_softcap() == (0.25, None)


@pytest.mark.parametrize("build, match", [
    (lambda z: torch.tanh(torch.tanh(z / 3.0)) * 3.0, "2 times"),
    (lambda z: torch.tanh(z / 3.0) * -3.0, "positive cap"),
])
def test_what_is_not_one_positive_softcap_is_an_error(build, match):
    with pytest.raises(RuntimeError, match=match):
        build(_steps()).scale_and_softcap()


def test_other_operations_on_the_logits_are_refused():
    with pytest.raises(RuntimeError, match="applies"):
        torch.sigmoid(_steps() / 3.0)


def _loss_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def _check(ref, plain, ours, ids, loss=True):
    (r, rg), (p, pg), (o, og) = (_loss_grads(m, ids) for m in (ref, plain, ours))
    if loss:
        assert_within_rule(o, p, r, 2, name="loss")
    assert set(og) == set(pg) == set(rg)
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")


def _triple(dtype, cap, **config):
    torch.manual_seed(0)
    ref = GEMMA2.build(final_logit_softcapping=cap, **config)().double().train()
    ref.config._attn_implementation = reference_attention(ref.config)
    plain = copy.deepcopy(ref).to(dtype)
    plain.config._attn_implementation = unconverted_attention(plain.config)
    return ref, plain, convert(copy.deepcopy(plain))


def test_capped_loss_bfloat16_within_the_rule():
    """Gradients by the rule on one batch; the loss, one scalar whose 16-bit error is a matter of rounding luck
    (on CPUs without bf16 dot products ours missed 2x eager's on one batch and met it on the next), by the
    rule on its error summed over eight batches."""
    models = _triple(torch.bfloat16, 2.0)
    ids, _ = batch(pad_rows=False)
    _check(*models, ids, loss=False)
    errors = {"ours": 0.0, "eager": 0.0}
    for seed in range(8):
        ids, _ = batch(pad_rows=False, seed=seed)
        r, p, o = (_loss_grads(m, ids)[0] for m in models)
        errors["ours"] += max_err(o, r)
        errors["eager"] += max_err(p, r)
    assert errors["ours"] <= 2 * errors["eager"] + 1e-5, errors


def test_capped_loss_through_a_lora_head():
    """A LoRA adapter on lm_head: the head runs as a module on chunks of rows, each chunk's logits capped."""
    from peft import LoraConfig, get_peft_model

    def lora(model):
        torch.manual_seed(5)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"],
                                                init_lora_weights=False))

    # a head of its own: LoRA on a head tied to the embedding would want peft's ensure_weight_tying, which puts
    # an adapter on the embedding too
    ref, plain, _ = _triple(torch.float32, 2.0, tie_word_embeddings=False)
    ours = convert(lora(copy.deepcopy(plain)))
    ids, _ = batch(pad_rows=False)
    _check(lora(ref), lora(plain), ours, ids)
