"""Llama 4 beyond the shared family checks (tests/models/families/llama4.py): chunked attention against an
independent float64 reference with the chunk mask (left and right padding, packed documents, a sequence the chunk
does not divide, a chunk past the sequence); the converted MoE block against transformers' own in float64; the
experts' matmuls against the top-k share of transformers' (which runs every token through every expert); MLP tiles;
what convert refuses by name, changing nothing, and what the composite leaves as it is."""

import copy
import logging
import types

import pytest
import torch

import selective_ckpt
from selective_ckpt import ConversionError, keeping, set_recompute
from selective_ckpt.models import attention as hf_attention
from selective_ckpt.models.configuration import layer_estimate
from tests.models.families.llama4 import _KINDS, LLAMA4
from tests.models.hf_checks import batch, kept_bytes_per_layer
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")


def _model(**kw):
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**{**LLAMA4, **kw}))
    model.config._attn_implementation = "sdpa"
    return model


def _chunk_allowed(pad, chunk, documents=None):
    """[B, 1, S, S] bool, written out from the definition: query i attends real keys j <= i of its own chunk, chunks
    of `chunk` tokens counted from each row's first real token, or from each document's start (documents: the
    start positions of one row's packed documents)."""
    B, S = pad.shape
    i = torch.arange(S)
    if documents is None:
        first = (pad.long().cumsum(-1) == 0).sum(-1)  # left padding
        position, doc = i[None, :] - first[:, None], torch.zeros(B, S, dtype=torch.long)
    else:
        doc = torch.bucketize(i, torch.tensor(documents[1:]), right=True)[None, :]
        position = (i - torch.tensor(documents)[doc[0]])[None, :]
    part = torch.div(position, chunk, rounding_mode="floor")
    ok = ((i[:, None] >= i[None, :]) & (part[:, :, None] == part[:, None, :]) & (doc[:, :, None] == doc[:, None, :])
          & pad[:, None, :])
    return ok[:, None]


def _materialised(q, k, v, allowed):
    """softmax(q k^T / sqrt(D) over the allowed keys) v in the inputs' dtype, rows with nothing allowed 0;
    [B, S, H, D]."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    anything = allowed.any(-1, keepdim=True)
    p = torch.softmax(torch.where(anything, s.masked_fill(~allowed, float("-inf")), 0.0), -1) * anything
    return (p @ v).transpose(1, 2)


def _chunked_module(chunk):
    config = types.SimpleNamespace(layer_types=["chunked_attention"], attention_chunk_size=chunk)
    return types.SimpleNamespace(config=config, layer_idx=0, is_causal=True, training=True)


def _padding(B, S, left, right):
    pad = torch.ones(B, S, dtype=torch.bool)
    for b, n in left.items():
        pad[b, :n] = False
    for b, n in right.items():
        pad[b, S - n:] = False
    return pad


@pytest.mark.parametrize("B, S, chunk, left, right, documents", [
    (2, 19, 7, {1: 4}, {}, None),  # left padding shifts the second row's chunks
    (3, 20, 6, {0: 3}, {2: 5}, None),  # left and right padding, a sequence the chunk does not divide
    (2, 24, 8, {}, {}, None),  # no padding, a sequence the chunk divides
    (2, 13, 32, {1: 2}, {}, None),  # a chunk past the sequence: causal + key padding
    (1, 23, 7, {}, {}, [0, 9, 14]),  # packed documents, chunks counted from each document's start
    (1, 1, 7, {}, {}, None),
])
def test_chunked_attention_against_float64(B, S, chunk, left, right, documents):
    """Real queries' outputs within 2x, q, k, v gradients within 3x of the float32 materialised attention's error
    against float64, the mask written out from the definition (padded queries feed nothing real, and their rows are
    a segment of padding of their own: not compared)."""
    H, Hkv, D = 4, 2, 16
    g = torch.Generator().manual_seed(B * 100 + S)
    pad = _padding(B, S, left, right)
    allowed = _chunk_allowed(pad, chunk, documents)
    q64, k64, v64 = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64).transpose(1, 2) for h in (H, Hkv, Hkv))
    dout = torch.randn(B, S, H, D, generator=g, dtype=torch.float64) * pad[:, :, None, None]

    def run(fn, dtype):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
        out = fn(q, k, v)
        (out[pad].double() * dout[pad]).sum().backward()
        return out[pad].detach(), q.grad, k.grad, v.grad

    def ours(q, k, v):
        mask = None if pad.all() and documents is None and S <= chunk else allowed
        return hf_attention.selective_attention(_chunked_module(chunk), q, k, v, mask)[0]

    ref = run(lambda q, k, v: _materialised(q, k, v, allowed), torch.float64)
    plain = run(lambda q, k, v: _materialised(q, k, v, allowed), torch.float32)
    mine = run(ours, torch.float32)
    for name, o, p, r, factor in zip(("output", "dq", "dk", "dv"), mine, plain, ref, (2, 3, 3, 3)):
        assert_within_rule(o, p, r, factor, name=name)


def test_chunk_segments_cut_rows_documents_and_padding():
    """The segments the kernel runs: rows laid end to end, cut at every chunk (from each row's first real token),
    at padding and at row ends; None for plain causal attention."""
    from selective_ckpt.models.chunked_attention import segments

    pad = _padding(2, 19, {1: 4}, {})
    cu = segments(_chunk_allowed(pad, 7)[:, 0], 2, 19, 7, "test")
    assert cu.tolist() == [0, 7, 14, 19, 23, 30, 37, 38]
    assert segments(None, 2, 7, 7, "test") is None
    assert segments(None, 1, 20, 7, "test", torch.tensor([0, 9, 20], dtype=torch.int32)).tolist() == \
        [0, 7, 9, 16, 20]


def test_a_mask_other_than_chunked_runs_sdpa_warned():
    """The mask decides the segments (a causal mask over a chunked layer's rows runs causal); a mask of no segments
    (a query that sees its neighbour but not an earlier key) runs transformers' SDPA with it, warned."""
    hf_attention._WARNED.discard("mask")
    q = torch.randn(1, 2, 12, 8)
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    out = hf_attention.selective_attention(_chunked_module(5), q, q, q, allowed)[0]
    torch.testing.assert_close(out, _materialised(q, q, q, allowed))
    allowed = allowed.clone()
    allowed[..., 7, 2] = False
    with pytest.warns(UserWarning, match="not chunked causal attention"):
        out = hf_attention.selective_attention(_chunked_module(5), q, q, q, allowed)[0]
    torch.testing.assert_close(out, _materialised(q, q, q, allowed))


def test_moe_block_against_transformers_float64():
    """The converted Llama4TextMoe (router, top-k experts on score-scaled input, shared expert) against
    transformers' own (every expert on every token) in float64: output and every parameter's and the input's
    gradient."""
    plain = _model(num_experts_per_tok=2).double()
    ours = selective_ckpt.convert(copy.deepcopy(plain))
    x = torch.randn(2, 11, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(22, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    results = []
    for model in (plain, ours):
        block = model.model.layers[1].feed_forward
        xs = x.clone().requires_grad_()
        out, _ = block(xs)
        out.backward(dy)
        results.append([out.detach(), xs.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_experts_run_the_top_k_share_of_transformers_matmuls():
    """transformers runs every token through every expert (torch.bmm); the converted experts run each token's
    top-k: their grouped matmuls are exactly k/E of transformers' bmm FLOPs, forward and backward, and every other
    matmul (aten.mm, aten.addmm) is run as often as transformers runs it."""
    from torch.utils.flop_counter import FlopCounterMode

    plain = _model()
    ours = selective_ckpt.convert(copy.deepcopy(plain))
    ids, _ = batch(pad_rows=False)
    counts = []
    for model in (plain, ours):
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        counts.append({str(k): v for k, v in counter.get_flop_counts()["Global"].items()})
    dense = [sum(c.get(k, 0) for k in ("aten.mm", "aten.addmm")) for c in counts]
    assert dense[0] == dense[1] > 0
    k, experts = LLAMA4["num_experts_per_tok"], LLAMA4["num_local_experts"]
    assert counts[1]["selective_ckpt.grouped_mm"] * experts == counts[0]["aten.bmm"] * k


def test_moe_in_mlp_tiles_matches_untiled():
    """"full" with the MoE blocks in 2 sequence tiles: the loss and the gradients as untiled, up to rounding."""
    model = selective_ckpt.convert(_model())
    ids, mask = batch()
    results = []
    for policy in ("full", keeping.policy("full", mlp_tiles=2)):
        set_recompute(model, policy)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, form", [(k, "autocast") for k in _KINDS] + [(_KINDS[3], "bfloat16")],
                         ids=lambda x: x[0] if isinstance(x, tuple) else x)
def test_layer_keeps_its_estimate_in_16_bit(kind, form):
    """Under bf16 autocast (fp32 weights) and with bf16 weights, each kind of layer keeps exactly its estimate: the
    rotated q and k in q's dtype (Llama 4's RoPE rounds back to it), the router's scores in theirs."""
    ids, _ = batch(b=2, s=24, pad_rows=False)
    dtype = torch.bfloat16 if form == "bfloat16" else torch.float32
    autocast = torch.bfloat16 if form == "autocast" else None

    def layers(n):
        model = selective_ckpt.convert(_model(num_hidden_layers=n, **kind[1]).to(dtype).train())

        def forward(**inputs):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
                return model(**inputs)
        return forward

    kept = kept_bytes_per_layer(layers, {"input_ids": ids})
    layer = selective_ckpt.registry.recomputable_layers(selective_ckpt.convert(_model(num_hidden_layers=1,
                                                                                       **kind[1]).to(dtype)))[0]
    assert kept == layer_estimate(layer, ids.shape[1], ids.shape[0], autocast)


def test_attention_dropout_with_chunked_layers_is_refused_unchanged():
    model = _model(attention_dropout=0.1)
    with pytest.raises(ConversionError, match="attention_dropout=0.1 with chunked attention layers"):
        selective_ckpt.convert(model)
    assert model.config._attn_implementation == "sdpa"
    assert not selective_ckpt.registry.recomputable_layers(model)


def test_layer_tiles_on_chunked_layers_are_refused():
    model = selective_ckpt.convert(_model(interleave_moe_layer_step=64))
    set_recompute(model, keeping.policy("full", layer_tiles=2))
    ids, _ = batch(pad_rows=False)
    with pytest.raises(ValueError, match="chunked attention layer .* layer_tiles"):
        model(input_ids=ids, labels=ids).loss.backward()


def test_composite_says_what_it_leaves(caplog):
    from tests.models.families import by_name

    model = by_name("llama4").build()()
    with caplog.at_level(logging.INFO, logger="selective_ckpt"):
        selective_ckpt.convert(model)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "converted its text model language_model (Llama4ForCausalLM)" in said
    assert "vision_model (Llama4VisionModel)" in said and "multi_modal_projector" in said
    assert len(selective_ckpt.registry.recomputable_layers(model)) == LLAMA4["num_hidden_layers"]
