"""A converted Hugging Face model under torch.compile: one graph for the whole training forward, a decoder layer
traced with fullgraph=True keeping its eager bytes.

Converted layers run eager bookkeeping dynamo cannot trace (storage identities, the layer pipeline's saved-tensor
hooks, weak references, transformers' ContextVar): while dynamo traces, each of those steps stands aside, so the
traced graph is the computation alone; the outputs eager rebuilds are traced in checkpoint regions, which the
compiled backward recomputes. Gradients and loss of the compiled model against eager and float64:
tests/models/test_hf_plan_compile.py.
"""

import pytest
import torch

import selective_ckpt
from selective_ckpt import convert

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402


def llama(n):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=112, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=n, vocab_size=97)).train()


def gpt2(n):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=48, n_layer=n, n_head=4, n_inner=136,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()


@pytest.mark.parametrize("build,layers,padded", [(llama, 2, False), (llama, 3, False), (llama, 3, True),
                                                  (gpt2, 2, False)],
                         ids=["llama-2", "llama-3", "llama-3-padded", "gpt2-2"])
def test_torch_compile_sees_one_graph_for_the_training_forward(build, layers, padded):
    """No graph break in any layer nor in the fused loss head (the unconverted model is one graph too), whatever
    the depth, with a padded batch too (its mask described in the graph)."""
    model = convert(build(layers))
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids, attention_mask=mask if padded else None)
    assert [b.reason for b in explained.break_reasons] == []
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def _layer_and_inputs():
    model = convert(llama(1))
    layer = model.model.layers[0]
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(13)[None].expand(2, -1)
    return layer, x, dict(position_embeddings=model.model.rotary_emb(x, positions), position_ids=positions)


def test_decoder_layer_fullgraph_matches_eager():
    """A converted decoder layer compiled with fullgraph=True (inductor): eager's output and gradients."""
    layer, x, kw = _layer_and_inputs()
    dy = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(2))

    def run(fn):
        xi = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = fn(xi, **kw)
        y.backward(dy)
        return [y.detach(), xi.grad] + [p.grad for p in layer.parameters()]

    eager = run(layer)
    torch._dynamo.reset()
    got = run(torch.compile(layer, fullgraph=True))
    for i, (a, b) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"output {i}: {m}")


def test_torch_compile_fullgraph_layer_keeps_its_eager_bytes():
    """The compiled layer keeps what the eager layer keeps, but for the two norms' fp32 statistics: the outputs
    eager rebuilds through its pipeline's saved-tensor hooks (norm outputs, the gated product), which stand aside
    under compile, are traced in checkpoint regions, so the compiled backward recomputes them (the partitioner
    alone keeps a custom op's output: 2h + f per token more), and the norms' statistics with them."""
    layer, x, kw = _layer_and_inputs()
    cos, sin = kw["position_embeddings"]
    kept = selective_ckpt.memory.ledger(layer, x.clone().requires_grad_(True), exclude=[cos, sin], **kw).total
    torch._dynamo.reset()
    y = torch.compile(layer, fullgraph=True)(x.clone().requires_grad_(True), **kw)
    statistics = 2 * x.shape[0] * x.shape[1] * 4  # one fp32 rstd per token for each of the two norms
    assert selective_ckpt.memory.graph_saved_bytes(y, exclude=[layer, cos, sin]) == kept - statistics


def test_torch_compile_describes_key_padding_and_refuses_other_masks_in_the_graph():
    """Traced, a mask is described without a branch on its values: the key padding eager finds (all True where
    eager finds none), and a mask eager would describe otherwise (packed documents) fails in the graph."""
    from selective_ckpt.models.attention import _cached_describe, describe_mask

    s = 6
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    padded = causal[None, None].repeat(2, 1, 1, 1)
    padded[1, ..., 4:] = False
    docs = causal.clone()
    docs[3:, :3] = False  # two documents of three tokens
    torch._dynamo.reset()
    traced = torch.compile(lambda m, b: _cached_describe(m, b, s, None, "attn", 4), backend="aot_eager",
                           fullgraph=True)
    pad, cu = traced(padded, 2)
    assert cu is None and torch.equal(pad, describe_mask(padded, 2, s, None, "attn", 4)[0])
    pad, cu = traced(causal[None, None], 1)
    assert cu is None and bool(pad.all())
    with pytest.raises(RuntimeError, match="causal \\+ key padding"):
        traced(docs[None, None], 1)
