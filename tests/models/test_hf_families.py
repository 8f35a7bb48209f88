"""Every Hugging Face family convert() supports, each through the same checks (tests/models/families):
the rule against float64 (padded and not), bf16, state dict and save/load both ways, greedy generate,
LoRA before and after convert, packed documents, bytes kept per layer equal to the estimate, no matmul
run twice in a training step, the classification heads, and a 20-step AdamW run that follows the
unconverted model's losses; where a family's entry asks for them, its sliding window, its dropouts
bit-identical across recompute modes, and other forms of its layers against float64.
"""

import copy

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers
from tests.models import hf_checks
from tests.models.families import collect
from tests.models.hf_checks import (
    VOCAB,
    assert_matches_reference,
    batch,
    kept_bytes_per_layer,
    triple,
    unconverted_attention,
)

pytest.importorskip("transformers")

FAMILIES = collect()
every_family = pytest.mark.parametrize("family", FAMILIES, ids=str)


@every_family
def test_rule_state_save_load_generate(family, tmp_path):
    hf_checks.check_family_basics(family.build(), tmp_path, family.causal_lm)


@every_family
def test_bfloat16_within_the_rule(family):
    ref, plain, ours = triple(family.build(), torch.bfloat16)
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("family", [pytest.param(f, marks=f.skips("matmuls")) for f in FAMILIES], ids=str)
def test_no_matmul_is_repeated(family):
    """A converted training step (forward, loss with labels, backward) runs the Linear layers' and the loss
    head's matmuls exactly as often as transformers' does: the recompute rebuilds elementwise results only.
    torch.utils.flop_counter counts aten.mm and aten.addmm (attention's own products are not compared:
    transformers' eager attention, which capped Gemma2 runs, does them as bmm)."""
    from torch.utils.flop_counter import FlopCounterMode

    _, plain, ours = triple(family.build())
    ids, _ = batch(pad_rows=False)
    flops = []
    for model in (plain, ours):
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
        # MoE experts run grouped matmuls (selective_ckpt.grouped_mm, counted by its own formula)
        flops.append(sum(counts.get(k, 0) for k in ("aten.mm", "aten.addmm", "selective_ckpt.grouped_mm")))
    assert flops[0] > 0
    assert flops[1] == flops[0]


@every_family
def test_lora_both_orders(family):
    hf_checks.check_lora_both_orders(family.build(), family.lora_targets)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.packed], ids=str)
def test_packed_documents_stay_apart(family):
    """position_ids restarting per document, no attention_mask: documents never attend each other."""
    ref, plain, ours = triple(family.build())
    ids, _ = batch(b=1, s=23)
    pos = torch.tensor([list(range(9)) + list(range(5)) + list(range(9))])
    assert_matches_reference(ref, plain, ours, input_ids=ids, position_ids=pos, use_cache=False)
    other = ids.clone()
    other[:, :9] = (other[:, :9] + 1) % VOCAB
    with torch.no_grad():
        whole = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
        changed = ours(input_ids=other, position_ids=pos, use_cache=False).logits
        first = ours(input_ids=ids[:, :9]).logits
    assert torch.equal(whole[:, 9:], changed[:, 9:])
    torch.testing.assert_close(whole[:, :9], first, rtol=1e-5, atol=1e-5)


@every_family
def test_layer_keeps_its_estimate(family):
    """Train mode: the bytes one converted layer keeps after forward (a 2-layer minus a 1-layer model) are
    exactly memory.estimate for its shape, and less than the unconverted layer keeps; a hybrid family's layers
    kind by kind (its kv cache off: a cache of linear-attention layers alone cannot build the attention mask)."""
    ids, _ = batch(b=2, s=24, pad_rows=False)
    for kind, kw in family.layer_kinds or (("", {}),):
        inputs = {"input_ids": ids, "use_cache": False} if kind else {"input_ids": ids}

        def layers(n, converted=True):
            torch.manual_seed(0)
            model = family.build(num_hidden_layers=n, **kw)().train()
            model.config._attn_implementation = unconverted_attention(model.config)
            return convert(model) if converted else model

        ours = kept_bytes_per_layer(layers, inputs)
        layer = recomputable_layers(layers(1))[0]
        assert ours == layer_estimate(layer, ids.shape[1], ids.shape[0]), kind
        assert kept_bytes_per_layer(lambda n: layers(n, False), inputs) > ours, kind


@pytest.mark.parametrize("family, head", [(f, h) for f in FAMILIES for h in f.heads],
                         ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_classification_heads_convert(family, head):
    ref, plain, ours = triple(lambda: head(family.config(**family.tiny, num_labels=3)))
    assert len(recomputable_layers(ours)) == family.tiny["num_hidden_layers"]
    ids, _ = batch(pad_rows=False)
    assert_matches_reference(ref, plain, ours, input_ids=ids)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.window], ids=str)
def test_window_is_applied(family):
    """Tokens further back than the window reach a query only through earlier layers, never directly."""
    hf_checks.check_window_applied(family.build(num_hidden_layers=1), family.window)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.dropout], ids=str)
def test_modes_bit_identical_with_dropout(family):
    _, _, ours = triple(family.build(**family.dropout))
    ids, mask = batch()
    hf_checks.check_modes_identical(ours, ids, mask)


@pytest.mark.parametrize("family, variant", [(f, v) for f in FAMILIES for v in f.variants],
                         ids=lambda x: x[0] if isinstance(x, tuple) else str(x))
def test_variant_within_the_rule(family, variant):
    _, kw = variant
    ref, plain, ours = triple(family.build(**kw))
    ids, mask = batch()
    assert_matches_reference(ref, plain, ours, input_ids=ids, attention_mask=mask)


def _losses(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@every_family
def test_training_follows_the_unconverted_losses(family):
    """20 AdamW steps from the same initialisation and data, fp32: every step's loss within 1e-4 relative; for a
    family whose run amplifies rounding (Family.amplifies_rounding), within 3x the largest gap between transformers'
    own eager and SDPA runs."""
    torch.manual_seed(0)
    plain = family.build()().train()
    plain.config._attn_implementation = unconverted_attention(plain.config)
    eager = copy.deepcopy(plain) if family.amplifies_rounding else None
    ours = convert(copy.deepcopy(plain))
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, VOCAB, (2, 17), generator=g) for _ in range(2)] * 10  # two batches to learn
    theirs, converted = _losses(plain, data), _losses(ours, data)
    assert theirs[-1] < theirs[0], "the run must learn something for the comparison to mean anything"
    bound = 1e-4
    if eager is not None:
        eager.config._attn_implementation = "eager"
        gap = max(abs(e - p) / abs(p) for p, e in zip(theirs, _losses(eager, data)))
        bound = max(bound, 3 * gap)
    for step, (p, o) in enumerate(zip(theirs, converted)):
        assert abs(o - p) <= bound * abs(p), f"step {step}: converted loss {o} against {p} (bound {bound:.1e})"
