"""The layer pipeline's short paths (keeping.pipeline): a parameter (or a view of one) is kept without a lookup, and a
rebuild run while gradients are on (a backward with create_graph=True) still rebuilds without a graph; gradients
against float64 eager, the dropped output rebuilt exactly once."""

import torch
import torch.nn.functional as F

from selective_ckpt.keeping import pipeline
from tests.reference import assert_within_rule


def _layer(x, w1, w2, calls):
    """y = 2 * x * x registered as dropped (rebuilt by counting calls), then two Linears reading it."""
    y = x * x * 2

    def rebuild(x):
        calls.append(torch.is_grad_enabled())
        return x * x * 2

    pipeline.discardable(y, rebuild, x)
    return F.linear(F.linear(y, w1).tanh(), w2)


def _eager(x, w1, w2, dtype, loss):
    """The gradients of plain PyTorch in `dtype` (float64: the reference)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w1, w2)]
    xd, w1d, w2d = leaves
    return torch.autograd.grad(loss(F.linear(F.linear(xd * xd * 2, w1d).tanh(), w2d)), leaves)


def _check(got, x, w1, w2, loss):
    for g, e, r, name in zip(got, _eager(x, w1, w2, torch.float32, loss), _eager(x, w1, w2, torch.float64, loss),
                             ("dx", "dw1", "dw2")):
        assert_within_rule(g, e, r, 3, name=name)


def _inputs(B, S, h, f, o, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, h, generator=g).requires_grad_()
    return x, torch.nn.Parameter(torch.randn(f, h, generator=g)), torch.nn.Parameter(torch.randn(o, f, generator=g))


def test_parameters_are_kept_as_themselves_and_outputs_dropped(monkeypatch):
    x, w1, w2 = _inputs(3, 7, 5, 11, 4, seed=0)
    packed = []
    real = pipeline._LayerPipeline.pack

    def spy(self, t):
        r = real(self, t)
        packed.append((t, r))
        return r
    monkeypatch.setattr(pipeline._LayerPipeline, "pack", spy)
    calls = []
    with pipeline.scope("selective", layer_input=x):
        out = _layer(x, w1, w2, calls)
    weights = [(t, r) for t, r in packed if any(t is w or t._base is w for w in (w1, w2))]
    assert len(weights) == 2  # each Linear saves its weight (transposed, a view of it)
    for t, r in weights:
        assert not isinstance(r, pipeline._View) and r.data_ptr() == t.data_ptr() and r.stride() == t.stride()
    assert sum(isinstance(r, pipeline._View) for _, r in packed) == 1  # y, read back by the first Linear
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (x, w1, w2), grad)
    assert calls == [False]
    _check(got, x, w1, w2, lambda out: (out * grad.to(out.dtype)).sum())


def test_a_rebuild_under_create_graph_runs_without_a_graph():
    x, w1, w2 = _inputs(2, 9, 6, 13, 3, seed=1)
    calls = []
    with pipeline.scope("selective", layer_input=x):
        out = _layer(x, w1, w2, calls)
    got = torch.autograd.grad(out.pow(2).sum(), (x, w1, w2), create_graph=True)
    assert calls == [False]  # rebuilt once, under no_grad although the backward records a graph
    _check(got, x, w1, w2, lambda out: out.pow(2).sum())
