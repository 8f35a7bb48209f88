"""memory.ledger on small modules whose saved tensors are known by hand, on the eager baseline
layer (counted from nn.MultiheadAttention's math path), under torch.utils.checkpoint and selective
checkpointing."""


import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from selective_ckpt import memory
from selective_ckpt.models.eager import EagerDecoderLayer

F32 = 4


# ---------------------------------------------------------------------------------------------
# Ledger on modules whose saves are known


class Gate(nn.Module):
    """sigmoid saves its output; the product saves both factors."""

    def forward(self, a, b):
        return torch.sigmoid(a) * b


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 3 * d)
        self.gate = Gate()

    def forward(self, x):
        qkv = self.lin(x)  # Linear saves its input x; its weight is a parameter (excluded)
        q, k, v = qkv.chunk(3, dim=-1)  # views of one storage
        return self.gate(q * k, v)  # mul saves q and k (views of qkv); Gate saves sigmoid(q*k), v (qkv)


def test_ledger_counts_distinct_storage_and_attributes_modules():
    torch.manual_seed(0)
    d, rows = 8, 5
    block = Block(d)
    x = torch.randn(rows, d, requires_grad=True)
    rep = memory.ledger(block, x)
    # x (rows*d), qkv buffer once (rows*3d: q, k, v are views of it), sigmoid output (rows*d).
    assert rep.total == (rows * d + rows * 3 * d + rows * d) * F32
    sizes = sorted(e.bytes for e in rep.entries)
    assert sizes == sorted([rows * d * F32, rows * 3 * d * F32, rows * d * F32])
    qkv = next(e for e in rep.entries if e.bytes == rows * 3 * d * F32)
    assert qkv.views >= 3 and qkv.module == "Block"  # saved by the mul in Block's own forward (the root)
    sig = next(e for e in rep.entries if e.op == "aten.sigmoid")
    assert sig.module == "gate" and sig.grad_fn == "SigmoidBackward0"
    xin = next(e for e in rep.entries if e.op == "input")
    assert xin.module == "lin" and xin.shape == (rows, d)
    assert rep.by_module == {"lin": rows * d * F32, "Block": rows * 3 * d * F32, "gate": rows * d * F32}
    text = rep.table()
    assert "aten.sigmoid" in text and str(rep.total) in text


def test_ledger_excludes_parameters_and_buffers():
    lin = nn.Linear(6, 6, bias=False)
    lin.register_buffer("scale", torch.full((6,), 2.0))
    x = torch.randn(3, 6, requires_grad=True)

    def fn(x):
        return lin(x) * lin.scale * lin.weight[0]  # weight.t() saved by mm, a view of weight[0] by mul

    assert memory.ledger(fn, x, exclude=[lin]).total == 3 * 6 * F32 * 2  # x and lin(x)
    # Without naming lin, the pre-hook still excludes the parameters of every module that runs.
    assert memory.ledger(fn, x).total == 3 * 6 * F32 * 2


def test_ledger_frees_the_graph_and_keeps_nothing_alive():
    block = Block(4)
    x = torch.randn(2, 4, requires_grad=True)
    rep = memory.ledger(block, x)
    assert rep.total > 0
    tracker = memory.StorageTracker()
    with tracker:
        memory.ledger(block, x)
    assert tracker.current == 0  # everything the forward allocated is gone after the ledger


def test_ledger_no_grad_inputs_still_keep_what_weight_grads_need():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)  # no grad: Linear still keeps x for its weight gradient
    assert memory.ledger(lin, x).total == 3 * 4 * F32


def test_ledger_checkpoint_counts_region_inputs_only():
    torch.manual_seed(0)
    block = Block(8)
    x = torch.randn(4, 8, requires_grad=True)
    rep = memory.ledger(lambda t: checkpoint(block, t, use_reentrant=False), x)
    assert rep.total == 4 * 8 * F32
    assert [e.op for e in rep.entries] == ["input"]
    y = torch.randn(4, 8, requires_grad=True)
    rep2 = memory.ledger(lambda a, b: checkpoint(lambda u, w: block(u) * w, a, b, use_reentrant=False), x, y)
    assert rep2.total == 2 * 4 * 8 * F32


def test_ledger_sac_reports_cached_matmuls():
    torch.manual_seed(0)
    w = torch.randn(8, 16, requires_grad=True)

    def region(x):
        return torch.relu(x @ w).sin()

    x = torch.randn(5, 8, requires_grad=True)
    rep = memory.ledger(lambda t: checkpoint(region, t, use_reentrant=False, context_fn=memory.sac_context_fn()), x,
                        exclude=[w])
    assert rep.total == (5 * 8 + 5 * 16) * F32  # the region input and the mm output
    assert sorted(e.op for e in rep.entries) == ["input", "sac:mm.default"]


def test_ledger_eager_layer_matches_hand_count():
    # nn.MultiheadAttention's math path (need_weights=True) keeps: LN1 out (in_proj input), q*scale,
    # the qkv buffer (k^T and v views), the softmax output [B*a, S, S], the attention output (out_proj
    # input); then x1 (LN2 input), LN2 out, fc1 out, GELU out; plus x and both LayerNorms' mean/rstd.
    torch.manual_seed(0)
    for (b, s, h, a) in [(2, 7, 16, 2), (1, 13, 24, 3)]:
        layer = EagerDecoderLayer(h, a)
        x = torch.randn(b, s, h, requires_grad=True)
        t = b * s
        elems = t * h * (1 + 1 + 1 + 3 + 1 + 1 + 1) + 2 * t * 4 * h + b * a * s * s
        expect = elems * F32 + 2 * 2 * t * F32
        rep = memory.ledger(layer, x)
        assert rep.total == expect, rep.table()
        assert list(rep.by_layer) == ["EagerDecoderLayer"]


def test_ledger_rejects_non_callables():
    with pytest.raises(TypeError, match="fn_or_module"):
        memory.ledger(3, torch.ones(1))
    with pytest.raises(TypeError, match="exclude"):
        memory.ledger(lambda t: t * 2, torch.ones(1), exclude=[3])


def test_ledger_sac_without_op_output_reads_the_cache(monkeypatch):
    # Older torch passes no op_output to the policy: the ledger then counts what the cache holds.
    from torch.utils import checkpoint as ckpt

    real = ckpt.SelectiveCheckpointContext.__init__

    def without_output(self, *, is_recompute, **kwargs):
        real(self, is_recompute=is_recompute, **kwargs)
        self.__dict__.pop("op_output", None)

    monkeypatch.setattr(ckpt.SelectiveCheckpointContext, "__init__", without_output)
    torch.manual_seed(0)
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(5, 8, requires_grad=True)
    rep = memory.ledger(lambda t: checkpoint(lambda u: torch.relu(u @ w).sin(), t, use_reentrant=False,
                                             context_fn=memory.sac_context_fn()), x, exclude=[w])
    assert rep.total == (5 * 8 + 5 * 16) * F32
    assert sorted(e.op for e in rep.entries) == ["input", "sac:cached"]


def test_graph_saved_bytes_agrees_with_the_ledger_and_excludes_parameters():
    # the bench measures compiled modules by walking their graph (the ledger's hooks would make
    # torch.compile fall back to eager); on eager modules both counts must agree
    from selective_ckpt import SelectiveDecoderLayer
    from selective_ckpt.bench.sdpa_layer import SDPADecoderLayer

    torch.manual_seed(0)
    x = torch.randn(2, 9, 64, requires_grad=True)
    for layer in (SelectiveDecoderLayer(64, 4), SDPADecoderLayer(64, 4)):
        assert memory.graph_saved_bytes(layer(x), exclude=[layer]) == memory.ledger(layer, x).total
    # nn.MultiheadAttention's math path also keeps one 8-byte scalar operand in a node attribute,
    # which the walk sees and saved-tensor hooks do not
    mha = EagerDecoderLayer(64, 4)
    assert 0 <= memory.graph_saved_bytes(mha(x), exclude=[mha]) - memory.ledger(mha, x).total <= 8
    lin = nn.Linear(8, 4)
    inp = torch.randn(3, 8)  # no grad: only the weight's gradient needs it saved
    assert memory.graph_saved_bytes(lin(inp), exclude=[lin]) == 3 * 8 * F32
