"""A converted Hugging Face model under torch.compile: one graph for the whole training forward, a decoder layer
traced with fullgraph=True keeping its eager bytes.

Converted layers run eager bookkeeping dynamo cannot trace (storage identities, the layer pipeline's saved-tensor
hooks, weak references, transformers' ContextVar): while dynamo traces, each of those steps stands aside, so the
traced graph is the computation alone and AOTAutograd's partitioner decides what it keeps. Gradients and loss of
the compiled model against eager: tests/models/test_hf_plan_compile.py.
"""

import pytest
import torch

import selective_ckpt
from selective_ckpt import convert

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def llama(n):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=112, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=n, vocab_size=97)).train()


@pytest.mark.parametrize("layers", [2, 3])
def test_torch_compile_sees_one_graph_for_the_training_forward(layers):
    """No graph break in any layer nor in the fused loss head (the unconverted model is one graph too), whatever
    the depth."""
    model = convert(llama(layers))
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
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


@pytest.mark.xfail(strict=True, reason="the compiled layer keeps its norm outputs and the gated product (2h + f per "
                   "token more): eager rebuilds them through the layer pipeline's saved-tensor hooks, which stand "
                   "aside under compile, and the partitioner never recomputes a custom op; a selective-checkpoint "
                   "policy around the layer is refused by dynamo where a layer sets a global inside (kernels' hub "
                   "layers set _ACTIVE_KERNEL_FUNCS)")
def test_torch_compile_fullgraph_layer_keeps_its_eager_bytes():
    layer, x, kw = _layer_and_inputs()
    cos, sin = kw["position_embeddings"]
    kept = selective_ckpt.memory.ledger(layer, x.clone().requires_grad_(True), exclude=[cos, sin], **kw).total
    torch._dynamo.reset()
    y = torch.compile(layer, fullgraph=True)(x.clone().requires_grad_(True), **kw)
    assert selective_ckpt.memory.graph_saved_bytes(y, exclude=[layer, cos, sin]) == kept
