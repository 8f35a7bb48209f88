"""Rows that attend nothing (left padding's pad rows) follow the unconverted model's own attention: our kernel
gives them 0 (its contract, as SDPA does), transformers' eager attention a uniform softmax over all keys (the
mean of v). The first real token is predicted from such a row, so the difference reaches the loss."""

import copy

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models import attention as converted_attention
from tests.models.families import by_name
from tests.models.hf_checks import batch, kept_bytes_per_layer

transformers = pytest.importorskip("transformers")


def _pair(name, reference, **kw):
    """(unconverted model on `reference` attention, converted copy that recorded it)."""
    torch.manual_seed(0)
    plain = by_name(name).build(**kw)().train()
    plain.config._attn_implementation = reference
    ours = copy.deepcopy(plain)
    converted_attention.record_reference(ours)
    return plain, convert(ours)


def _step(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(plain, ours, ids, mask):
    (pl, pg), (ol, og) = _step(plain, ids, mask), _step(ours, ids, mask)
    torch.testing.assert_close(ol, pl, rtol=1e-6, atol=1e-6)
    assert set(og) == set(pg)
    for n in pg:
        torch.testing.assert_close(og[n], pg[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name, reference", [("gemma2", "eager"), ("llama", "eager"), ("llama", "sdpa")])
def test_left_padded_batch_with_labels_follows_the_reference_attention(name, reference):
    """Loss and every gradient of a left-padded batch (labels on every position, pad rows included) equal the
    unconverted model's on its own attention: Gemma2's eager (its only one), Llama's eager or SDPA."""
    plain, ours = _pair(name, reference)
    assert converted_attention.reference_attention(ours.model.layers[0].self_attn) == reference
    ids, mask = batch(b=3, s=19)
    mask[2, :11] = 0  # a longer left padding than the sliding window (Gemma2's is 5)
    mask[0, -7:] = 0  # right padding: its last rows see pad keys only within Gemma2's window
    _assert_same_step(plain, ours, ids, mask)


def test_gemma2_needs_no_record():
    """A Gemma2 converted without a recorded reference follows eager, its family's only attention."""
    torch.manual_seed(0)
    plain = by_name("gemma2").build()().train()
    ours = convert(copy.deepcopy(plain))
    ours.model.layers[0].self_attn.__dict__.pop("_selective_ckpt_reference_attention", None)
    assert converted_attention.reference_attention(ours.model.layers[0].self_attn) == "eager"
    assert converted_attention.reference_attention(
        convert(by_name("llama").build()()).model.layers[0].self_attn) == "sdpa"


def test_rows_attending_nothing():
    """Left padding's pad rows; none for right padding, unless a sliding window holds pad keys only."""
    pad = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    dead = converted_attention.rows_attending_nothing(pad)
    assert dead.tolist() == [[True] * 3 + [False] * 3, [False] * 6, [False] * 6]
    windowed = converted_attention.rows_attending_nothing(pad, window=2)
    assert windowed.tolist() == [[True] * 3 + [False] * 3, [False] * 5 + [True], [False] * 6]


def test_unpadded_batches_keep_the_floor_and_padded_ones_one_more_output():
    """Without rows attending nothing the correction does not run: the layer keeps what it keeps on an SDPA
    reference; a left-padded batch keeps the attention output a second time (h elements per token, the
    out-projection's input) plus the rows' positions."""
    ids, mask = batch(b=2, s=24)

    def measure(reference, padded):
        def layers(n):
            return _pair("gemma2", reference, num_hidden_layers=n)[1]
        return kept_bytes_per_layer(layers, {"input_ids": ids, "attention_mask": mask if padded else None})

    unpadded = measure("eager", False)
    assert unpadded == measure("sdpa", False)
    extra = measure("eager", True) - unpadded
    o_bytes = 2 * 24 * 4 * 16 * 4  # B * S * H * D, float32
    assert o_bytes <= extra <= o_bytes + 1024
