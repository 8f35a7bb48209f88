"""memory.plan against brute force over every assignment of modes, and on a built model."""

import itertools

import pytest
import torch
from torch import nn

from selective_ckpt import memory

F32 = 4


# ---------------------------------------------------------------------------------------------
# Planner


SHAPE = dict(hidden_dim=64, num_heads=4, mlp_ratio=4, dtype=torch.bfloat16)


def _brute_force(num_layers, batch, seq, budget):
    """Least-cost assignment under the docstring's memory model, by enumeration."""
    est = {m: memory.estimate(64, 4, seq, batch, torch.bfloat16, recompute=m) for m in memory.MODES}
    cost = {m: memory.recompute_flops(64, 4, seq, batch, recompute=m) for m in memory.MODES}
    rerun = est["selective"] - est["full"]
    reruns = {"full": rerun, "attention-kept": est["selective"] - est["attention-kept"]}  # a checkpointed layer's
    best = None
    for modes in itertools.product(memory.MODES, repeat=num_layers):
        peak = sum(est[m] for m in modes) + max((reruns[m] for m in modes if m in reruns), default=0)
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
        # checkpointed layers first (their re-run comes last in backward), then selective, then none
        order = {"full": 0, "attention-kept": 1, "selective": 2, "none": 3}
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
            checkpointed = mode in ("full", "attention-kept")
            rerun = memory.estimate(64, 4, seq, batch, torch.bfloat16) - per if checkpointed else 0
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


def test_plan_reads_llama_layers_and_matches_a_shape_dict():
    layers = pytest.importorskip("selective_ckpt.layers")
    h, a, n, s, b = 32, 2, 3, 16, 2
    kw = dict(norm="rmsnorm", activation="swiglu", ffn_dim=88, rope_theta=1e4)
    model = nn.Sequential(*(layers.SelectiveDecoderLayer(h, a, bias=False, **kw) for _ in range(n)))
    per_layer = memory.estimate(h, a, s, b, torch.float32, **kw)
    full = memory.estimate(h, a, s, b, torch.float32, recompute="full", **kw)
    budget = 2 * full + per_layer + (per_layer - full)  # two full layers and one selective, with a re-run
    got = memory.plan(model, b, s, budget)
    assert sorted(got) == ["full", "full", "selective"]
    shape = dict(hidden_dim=h, num_heads=a, num_layers=n, norm="rmsnorm", activation="swiglu", ffn_dim=88)
    assert list(memory.plan(shape, b, s, budget)) == list(got)
    selective_ckpt_set = pytest.importorskip("selective_ckpt").set_recompute
    selective_ckpt_set(model, got)
    assert memory.ledger(model, torch.randn(b, s, h, requires_grad=True)).total == got.kept_bytes
