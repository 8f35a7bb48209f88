"""selective_ckpt.memory: the saved-tensor ledger, the analytic estimate, the planner, the tracker.

The ledger is checked on small modules whose saved tensors are known by hand, on the eager
baseline layer (counted from nn.MultiheadAttention's math path), under torch.utils.checkpoint and
selective checkpointing; estimate == ledger on SelectiveDecoderLayer for every mode and dtype;
plan against brute force over every assignment of modes.
"""

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from selective_ckpt import memory
from selective_ckpt.baseline import EagerDecoderLayer

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


# ---------------------------------------------------------------------------------------------
# Live-storage tracker


def test_storage_tracker_peak_and_release():
    tracker = memory.StorageTracker()
    with tracker:
        a = torch.ones(1000)  # 4000 B
        b = a + 1  # 8000 live
        v = b.view(10, 100)  # a view: no new storage
        b.add_(1)  # in place: no new storage
        del a  # 4000 live
        c = torch.zeros(500, dtype=torch.float64)  # +4000
        del c
    assert tracker.peak == 8000
    assert tracker.current == 4000
    del b, v
    assert tracker.current == 0


def test_storage_tracker_step_includes_grads():
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    tracker = memory.StorageTracker()
    with tracker:
        lin(x).sum().backward()
    grads = (64 * 64 + 64 + 32 * 64) * F32
    assert tracker.peak >= grads
    assert tracker.current == grads  # the grads stay; everything else was freed


@torch.library.custom_op("test_memory::with_scratch", mutates_args=())
def _with_scratch(x: torch.Tensor) -> torch.Tensor:
    scratch = torch.empty(4096, dtype=torch.float32)  # 16 KiB allocated and freed inside the op
    scratch.fill_(1.0)
    return x + scratch[: x.numel()].view_as(x)


def test_cpu_peak_bytes_counts_allocations_inside_ops():
    x = torch.ones(10)

    def fn():
        a = torch.ones(1000)  # 4000 B
        b = a + 1  # 8000 live
        del a
        c = torch.zeros(500, dtype=torch.float64)  # 8000 live again
        del b, c
        _with_scratch(x)  # 16384 scratch + 40 output inside the op

    assert memory.cpu_peak_bytes(fn) == 4096 * 4 + 40
    tracker = memory.StorageTracker()
    with tracker:
        fn()
    assert tracker.peak == 8000  # sees op outputs only: the custom op's scratch is invisible to it


# ---------------------------------------------------------------------------------------------
# Estimate


@pytest.mark.parametrize("dtype,e", [(torch.float32, 4), (torch.bfloat16, 2), ("fp16", 2)])
def test_estimate_formulas(dtype, e):
    h, a, s, b = 64, 4, 9, 3
    t = s * b
    extra = a * t * 4 + 2 * 2 * t * 4  # lse + LayerNorm mean/rstd, fp32
    assert memory.estimate(h, a, s, b, dtype, recompute="selective") == 10 * t * h * e + extra
    assert memory.estimate(h, a, s, b, dtype, recompute="none") == 16 * t * h * e + extra
    assert memory.estimate(h, a, s, b, dtype, recompute="full") == t * h * e
    # mlp_ratio 2: fc1 output (and GELU output for "none") are 2h wide
    assert memory.estimate(h, a, s, b, dtype, mlp_ratio=2, recompute="selective") == 8 * t * h * e + extra
    assert memory.estimate(h, a, s, b, dtype, mlp_ratio=2, recompute="none") == 12 * t * h * e + extra
    parts = memory.estimate(h, a, s, b, dtype, breakdown=True)
    assert sum(parts.values()) == memory.estimate(h, a, s, b, dtype)
    assert parts["lse"] == a * t * 4


def test_estimate_design_7b_cut():
    # DESIGN.md: 20 bytes per s*b*h in bf16 at the 7B shape (plus lse and LN stats)
    h, a, s = 4096, 32, 2048
    est = memory.estimate(h, a, s, 1, torch.bfloat16)
    assert est - (a * s * 4 + 4 * s * 4) == 20 * s * h


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_dim=10, num_heads=3), "divisible"),
    (dict(hidden_dim=0), "hidden_dim"),
    (dict(seq_len=0), "seq_len"),
    (dict(batch=1.5), "batch"),
    (dict(recompute="some"), "recompute"),
    (dict(mlp_ratio=-1), "mlp_ratio"),
])
def test_estimate_rejects_bad_arguments(kwargs, match):
    args = dict(hidden_dim=16, num_heads=2, seq_len=4, batch=1, dtype=torch.float32) | kwargs
    with pytest.raises(ValueError, match=match):
        memory.estimate(**args)


def test_estimate_rejects_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        memory.estimate(16, 2, 4, 1, torch.int32)
    with pytest.raises(TypeError, match="dtype"):
        memory.estimate(16, 2, 4, 1, "int8")


# ---------------------------------------------------------------------------------------------
# estimate == ledger on the layer


LAYER_CASES = [(1, 5, 32, 2), (2, 17, 48, 3), (3, 9, 64, 4)]  # (batch, seq, hidden, heads)


@pytest.mark.parametrize("mode", memory.MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_equals_ledger_on_the_layer(mode, dtype):
    layers = pytest.importorskip("selective_ckpt.layers")
    torch.manual_seed(0)
    for b, s, h, a in LAYER_CASES:
        layer = layers.SelectiveDecoderLayer(h, a, recompute=mode, dtype=dtype)
        x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
        rep = memory.ledger(layer, x)
        assert rep.total == memory.estimate(h, a, s, b, dtype, recompute=mode), rep.table()
        assert dict(rep.by_layer) == {"SelectiveDecoderLayer": rep.total}


@pytest.mark.parametrize("mode", memory.MODES)
def test_estimate_equals_ledger_with_dropout(mode):
    layers = pytest.importorskip("selective_ckpt.layers")
    h, a, s, b = 32, 4, 7, 2
    for p, p_attn in ((0.1, 0.0), (0.0, 0.2), (0.1, 0.2)):
        layer = layers.SelectiveDecoderLayer(h, a, dropout=p, attn_dropout=p_attn, recompute=mode)
        rep = memory.ledger(layer, torch.randn(b, s, h, requires_grad=True))
        assert rep.total == memory.estimate(h, a, s, b, torch.float32, recompute=mode, dropout=p,
                                            attn_dropout=p_attn), rep.table()


def test_estimate_equals_ledger_for_a_fractional_mlp_ratio():
    # 60 * 4.1 is 245.99999999999997 in floating point: estimate must size fc1 as the layer does.
    layers = pytest.importorskip("selective_ckpt.layers")
    h, a, s, b, ratio = 60, 4, 5, 2, 4.1
    layer = layers.SelectiveDecoderLayer(h, a, mlp_ratio=ratio)
    assert layer.fc1.out_features == 246
    rep = memory.ledger(layer, torch.randn(b, s, h, requires_grad=True))
    assert rep.total == memory.estimate(h, a, s, b, torch.float32, mlp_ratio=ratio)


def test_ledger_per_layer_in_a_stack():
    layers = pytest.importorskip("selective_ckpt.layers")
    torch.manual_seed(0)
    h, a, s, b = 32, 2, 6, 2
    stack = nn.Sequential(*(layers.SelectiveDecoderLayer(h, a, recompute=m) for m in ("none", "selective", "full")))
    x = torch.randn(b, s, h, requires_grad=True)
    rep = memory.ledger(stack, x)
    assert list(rep.by_layer.values()) == [memory.estimate(h, a, s, b, torch.float32, recompute=m)
                                           for m in ("none", "selective", "full")]


# ---------------------------------------------------------------------------------------------
# Planner


SHAPE = dict(hidden_dim=64, num_heads=4, mlp_ratio=4, dtype=torch.bfloat16)


def _brute_force(num_layers, batch, seq, budget):
    """Least-cost assignment under the docstring's memory model, by enumeration."""
    est = {m: memory.estimate(64, 4, seq, batch, torch.bfloat16, recompute=m) for m in memory.MODES}
    cost = {m: memory.recompute_flops(64, 4, seq, batch, recompute=m) for m in memory.MODES}
    rerun = est["selective"] - est["full"]
    best = None
    for modes in itertools.product(memory.MODES, repeat=num_layers):
        peak = sum(est[m] for m in modes) + (rerun if "full" in modes else 0)
        if peak <= budget:
            c = sum(cost[m] for m in modes)
            best = c if best is None else min(best, c)
    return best, est, rerun


@pytest.mark.parametrize("num_layers", [1, 2, 4])
def test_plan_is_optimal_against_brute_force(num_layers):
    batch, seq = 2, 32
    _, est, rerun = _brute_force(1, batch, seq, float("inf"))
    lo = num_layers * est["full"] + rerun
    hi = num_layers * est["none"]
    for frac in [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]:
        budget = int(lo + frac * (hi - lo))
        best, _, _ = _brute_force(num_layers, batch, seq, budget)
        p = memory.plan(dict(SHAPE, num_layers=num_layers), batch, seq, budget)
        assert len(p) == num_layers and set(p) <= set(memory.MODES)
        assert p.cost_flops == best
        assert p.peak_bytes <= budget
        assert p.kept_bytes == sum(est[m] for m in p)
        # full layers first (their re-run comes last in backward), then selective, then none
        order = {"full": 0, "selective": 1, "none": 2}
        assert [order[m] for m in p] == sorted(order[m] for m in p)


def test_plan_generous_budget_recomputes_nothing():
    p = memory.plan(dict(SHAPE, num_layers=3), 1, 16, 10**12)
    assert list(p) == ["none"] * 3 and p.cost_flops == 0


def test_plan_prefers_selective_over_full():
    batch, seq, n = 2, 32, 4
    est = {m: memory.estimate(64, 4, seq, batch, torch.bfloat16, recompute=m) for m in memory.MODES}
    p = memory.plan(dict(SHAPE, num_layers=n), batch, seq, n * est["selective"])
    assert list(p) == ["selective"] * n


def test_plan_infeasible_states_the_minimum():
    batch, seq, n = 2, 32, 3
    est = {m: memory.estimate(64, 4, seq, batch, torch.bfloat16, recompute=m) for m in memory.MODES}
    minimum = n * est["full"] + est["selective"] - est["full"]
    with pytest.raises(ValueError, match=f"minimum is {minimum} bytes"):
        memory.plan(dict(SHAPE, num_layers=n), batch, seq, minimum - 1)
    assert list(memory.plan(dict(SHAPE, num_layers=n), batch, seq, minimum)) == ["full"] * n


def test_plan_max_batch_per_uniform_mode():
    seq, n, budget = 64, 4, 3 * 2**20
    p = memory.plan(dict(SHAPE, num_layers=n), 1, seq, budget)
    for mode, b in p.max_batch.items():
        def peak(batch, mode=mode):
            per = memory.estimate(64, 4, seq, batch, torch.bfloat16, recompute=mode)
            rerun = memory.estimate(64, 4, seq, batch, torch.bfloat16) - per if mode == "full" else 0
            return n * per + rerun
        assert b >= 1 and peak(b) <= budget < peak(b + 1), mode
    assert p.max_batch["full"] > p.max_batch["selective"] > p.max_batch["none"]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="budget_bytes"):
        memory.plan(dict(SHAPE, num_layers=2), 1, 8, 0)
    with pytest.raises(ValueError, match="num_layers"):
        memory.plan(dict(SHAPE), 1, 8, 10**9)
    with pytest.raises(ValueError, match="recompute"):
        memory.plan(dict(SHAPE, num_layers=2), 1, 8, 10**9, modes=("none", "half"))
    with pytest.raises(TypeError, match="model_or_shape"):
        memory.plan("7b", 1, 8, 10**9)
    with pytest.raises(ValueError, match="batch"):
        memory.plan(dict(SHAPE, num_layers=2), 0, 8, 10**9)


def test_plan_on_a_model_and_set_recompute():
    layers = pytest.importorskip("selective_ckpt.layers")
    import selective_ckpt

    torch.manual_seed(0)
    h, a, s, b, n = 32, 2, 8, 2, 3
    model = nn.Sequential(*(layers.SelectiveDecoderLayer(h, a) for _ in range(n)))
    est = {m: memory.estimate(h, a, s, b, torch.float32, recompute=m) for m in memory.MODES}
    budget = est["none"] + est["selective"] + est["full"] + (est["selective"] - est["full"])
    p = memory.plan(model, b, s, budget)
    assert p.cost_flops == min(
        sum(memory.recompute_flops(h, a, s, b, recompute=m) for m in modes)
        for modes in itertools.product(memory.MODES, repeat=n)
        if sum(est[m] for m in modes) + (est["selective"] - est["full"]) * ("full" in modes) <= budget)
    selective_ckpt.set_recompute(model, p)
    x = torch.randn(b, s, h, requires_grad=True)
    assert memory.ledger(model, x).total == p.kept_bytes


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
