"""Converted mixtures of experts route their rows on the device: no host read of the routing in forward or
backward (so no device->host sync per MoE layer, and no graph break under torch.compile(fullgraph=True)), and
the same bits as a per-expert loop over the routed rows."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from selective_ckpt import convert
from selective_ckpt.models.moe import RoutedExperts, grouped_mm_op
from selective_ckpt.ops.gated_mlp import gated_product_op
from tests.models.families.moe import FAMILIES
from tests.models.hf_checks import batch

transformers = pytest.importorskip("transformers")

every_family = pytest.mark.parametrize("family", FAMILIES, ids=str)


class HostReads(TorchDispatchMode):
    """Counts what reads a tensor's values on the host: item / _local_scalar_dense (int(), bool(), .item()),
    ops whose output shape depends on the data (bincount, nonzero, ...), copies to another device, and
    Tensor.tolist (which reads memory without dispatching)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tags = getattr(func, "tags", ())
        if func is torch.ops.aten.index.Tensor:  # tagged for boolean masks; integer indices read nothing
            dynamic = any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        else:
            dynamic = torch.Tag.dynamic_output_shape in tags
        if (func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
                or dynamic or torch.Tag.data_dependent_output in tags):
            self.reads.append(str(func))
        if func is torch.ops.aten._to_copy.default and "device" in kwargs and isinstance(args[0], torch.Tensor) \
                and torch.device(kwargs["device"]) != args[0].device:
            self.reads.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def host_reads(monkeypatch):
    probe = HostReads()
    tolist = torch.Tensor.tolist

    def counted(self):
        probe.reads.append("Tensor.tolist")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return probe


def _block_pair(family, impl="eager", **kw):
    torch.manual_seed(0)
    plain = family.build(experts_implementation=impl, num_hidden_layers=1, **kw)().train()
    ours = convert(copy.deepcopy(plain))
    return plain.model.layers[0].mlp, ours.model.layers[0].mlp


def _run(block, x):
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y
    params = [p for p in block.parameters() if p.requires_grad]
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(), [x, *params])
    return y, grads


@every_family
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_moe_layer_reads_nothing_on_the_host(family, impl, host_reads):
    """A converted MoE block's forward and backward in training (router, routed experts, shared expert) read
    no routing value on the host: on a GPU, no sync per layer."""
    _, block = _block_pair(family, impl)
    x = torch.randn(2, 11, 64, requires_grad=True)
    with host_reads:
        _run(block, x)
    assert host_reads.reads == []


def test_the_probe_sees_a_host_read(host_reads):
    """The probe counts what the former routing did: bincount(...).tolist()."""
    index = torch.tensor([[0, 2], [1, 2]])
    with host_reads:
        torch.bincount(index.reshape(-1), minlength=4).tolist()
        int(index.max())
    assert {"aten.bincount.default", "Tensor.tolist", "aten._local_scalar_dense.default"} <= set(host_reads.reads)


@every_family
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_moe_block_training_compiles_with_fullgraph(family, impl):
    """The converted block's training forward and backward trace as one graph (fullgraph=True) and give the
    eager converted block's bits, and the unconverted block's values within float rounding."""
    plain, block = _block_pair(family, impl)
    x = torch.randn(2, 9, 64, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    y, grads = _run(compiled, x)
    ye, grads_e = _run(block, x)
    yp, grads_p = _run(plain, x)
    assert torch.equal(y, ye)
    for g, ge, gp in zip(grads, grads_e, grads_p):
        assert torch.equal(g, ge)
        torch.testing.assert_close(g, gp, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(y, yp, rtol=1e-5, atol=1e-6)


@every_family
def test_generate_with_a_compiled_fullgraph_forward(family):
    """transformers' compiled decoding (static cache, the forward compiled with fullgraph=True, then no
    recompilation) runs on the converted model, transformers' default experts implementation, and gives the
    unconverted model's tokens."""
    from transformers import CompileConfig

    torch.manual_seed(0)
    tiny = {k: v for k, v in family.tiny.items() if k != "experts_implementation"}
    plain = family.causal_lm(family.config(**tiny)).eval()
    ours = convert(copy.deepcopy(plain))
    ids, mask = batch(b=2, s=7)
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # transformers compiles generate's forward on accelerators only
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0)
    expected = plain.generate(ids, disable_compile=True, **kw)
    torch._dynamo.reset()
    assert torch.equal(ours.generate(ids, compile_config=config, **kw), expected)
    assert getattr(ours, "_compiled_call", None) is not None, "the forward was compiled"
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(ours.generate(ids, compile_config=config, **kw), expected)


@every_family
def test_no_grad_runs_transformers_experts(family, monkeypatch):
    """Without gradients nothing is kept, and the experts run transformers' own forward."""
    plain, block = _block_pair(family, "grouped_mm")
    calls = []
    own = type(block.experts).forward

    def spy(self, *args, **kwargs):
        calls.append(1)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(type(block.experts), "forward", spy)
    x = torch.randn(18, 64)
    with torch.no_grad():
        _, weights, index = (block.router if hasattr(block, "router") else block.gate)(x)  # gpt-oss: router
        y, yp = block.experts(x, index, weights), plain.experts(x, index, weights)
        whole = block(x[None])
    assert len(calls) == 3 and torch.equal(y, yp)  # the block's own call included
    whole = whole[0] if isinstance(whole, tuple) else whole
    torch.testing.assert_close(whole, _run(plain, x[None].requires_grad_())[0], rtol=1e-5, atol=1e-6)


def _loop_reference(x, gate_up, down, weights, index, reduce, dtype, product=None):
    """The routed experts as a loop over experts (rows in the order they are routed), each expert's rows
    through F.linear, weighted, then summed per token: in the promoted dtype ("sum"), or added into zeros
    of x's dtype expert by expert ("index_add"). `product(gate, up)`: silu(gate) * up, by default in
    float32 or wider and rounded once."""
    n, k = index.shape
    inter = down.shape[2]
    promoted = torch.promote_types(dtype, weights.dtype)
    rows = torch.zeros(n, k, x.shape[1], dtype=promoted)
    y = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(index == e)
        if tok.numel() == 0:
            continue
        gu = F.linear(x[tok].to(dtype), gate_up[e].to(dtype))
        gate, up = gu[:, :inter], gu[:, inter:]
        wide = torch.promote_types(dtype, torch.float32)
        p = product(gate, up) if product else (gate.to(wide) * torch.sigmoid(gate.to(wide)) * up.to(wide)).to(dtype)
        out = F.linear(p, down[e].to(dtype)) * weights[tok, slot, None]
        rows[tok, slot] = out
        y.index_add_(0, tok, out.to(y.dtype))
    return rows.sum(dim=1).to(x.dtype) if reduce == "sum" else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("hidden, inter", [(64, 48), (65, 33)], ids=["aligned", "odd"])
@pytest.mark.parametrize("reduce", ["sum", "index_add"])
def test_routed_experts_against_a_loop_over_experts(dtype, hidden, inter, reduce):
    """The device-side routing computes each token's rows as a per-expert loop does, and sums them in the
    order each implementation sums them (float64 and odd widths take the per-group fallback)."""
    torch.manual_seed(0)
    n, k, num_experts = 23, 2, 5
    x = torch.randn(n, hidden, dtype=dtype)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, dtype=dtype) * 0.1
    down = torch.randn(num_experts, hidden, inter, dtype=dtype) * 0.1
    weights, index = torch.topk(torch.randn(n, num_experts).softmax(-1), k, dim=-1)
    weights = weights.to(dtype)
    y = RoutedExperts.apply(x, gate_up, down, weights, index, "silu", reduce, dtype)
    expected = _loop_reference(x.double(), gate_up.double(), down.double(), weights.double(), index, reduce,
                               torch.float64)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
    # with the kernel's own product, the loop's bits: the same matmul per row and the same summing order
    same = _loop_reference(x, gate_up, down, weights, index, reduce, dtype,
                           product=lambda gate, up: gated_product_op(gate, up, "silu"))
    assert torch.equal(y, same)


def test_grouped_mm_op_against_matmuls_per_group():
    """selective_ckpt::grouped_mm, both forms, with empty groups, on its kernel and its per-group fallback,
    and torch.library.opcheck."""
    torch.manual_seed(0)
    ends = torch.tensor([4, 4, 11, 16], dtype=torch.int32)
    bounds = [(0, 4), (4, 4), (4, 11), (11, 16)]
    for dtype in (torch.float32, torch.float64):
        a = torch.randn(16, 32, dtype=dtype)
        b = torch.randn(4, 32, 24, dtype=dtype)
        out = grouped_mm_op(a, b, ends)
        assert torch.equal(out, torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(bounds)]))
        c = torch.randn(16, 8, dtype=dtype)
        w = grouped_mm_op(a.t(), c, ends)
        assert torch.equal(w, torch.stack([a[s:e].t() @ c[s:e] for s, e in bounds]))
        assert not w[1].any()
        torch.library.opcheck(grouped_mm_op, (a, b, ends))
        torch.library.opcheck(grouped_mm_op, (a.t(), c, ends))


@every_family
def test_no_matmul_is_repeated_with_grouped_experts(family):
    """A converted training step's matmul FLOPs (Linear layers, loss head, and the experts' grouped matmuls,
    which torch.utils.flop_counter counts through the op's formula) equal transformers' per-expert ones."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.models.hf_checks import triple

    _, plain, ours = triple(family.build())
    ids, _ = batch(pad_rows=False)
    totals = []
    for model in (plain, ours):
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
        totals.append(sum(counts.get(k, 0) for k in ("aten.mm", "aten.addmm", "selective_ckpt.grouped_mm")))
        if model is ours:
            assert counts["selective_ckpt.grouped_mm"] > 0
    assert totals[1] == totals[0] > 0
