"""Casts followed through the autograd graph (keeping.pipeline.scope's memo): after a first call that watches
every op and finds the graph shows every cast, a layer's later calls rebuild the same casts without watching,
with the same gradients; a cast the graph cannot show (a frozen weight's) keeps the watcher."""

import torch
import torch.nn.functional as F

from selective_ckpt.keeping import pipeline


def _step(x, w, memo, packed):
    x = x.detach().requires_grad_(x.requires_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pipeline.scope("selective", layer_input=x, watch_casts=True, memo=memo):
            y = pipeline.discardable(x * 2, torch.mul, x, 2)  # stands for a norm output
            out = F.linear(y, w)
    out.float().sum().backward()
    return x.grad, w.grad


def _spy(monkeypatch):
    packed = []
    real = pipeline._LayerPipeline.pack

    def pack(self, t):
        r = real(self, t)
        packed.append((t.dtype, isinstance(r, pipeline._View)))
        return r
    monkeypatch.setattr(pipeline._LayerPipeline, "pack", pack)
    return packed


def test_graph_follows_casts_after_learning(monkeypatch):
    packed = _spy(monkeypatch)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 8))
    memo, grads = {}, []
    for _ in range(3):
        packed.clear()
        w.grad = None
        grads.append(_step(x, w, memo, packed))
        # the bf16 casts of y and of the weight are rebuilt, whichever way they were found
        assert sum(rebuilt for dtype, rebuilt in packed if dtype == torch.bfloat16) == 2, packed
    assert list(memo.values()) == [False]  # the graph showed every cast: later calls do not watch
    for g in grads[1:]:
        assert torch.equal(g[0], grads[0][0]) and torch.equal(g[1], grads[0][1])
    w.grad = None
    plain = _step(x, w, None, packed)  # no memo: the watcher, as before
    assert torch.equal(plain[0], grads[0][0]) and torch.equal(plain[1], grads[0][1])


def test_frozen_weight_cast_keeps_the_watcher(monkeypatch):
    packed = _spy(monkeypatch)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)  # frozen: its cast has no graph node
    memo = {}
    for _ in range(2):
        packed.clear()
        _step(x, w, memo, packed)
        assert sum(rebuilt for dtype, rebuilt in packed if dtype == torch.bfloat16) == 1, packed  # the weight's
    assert list(memo.values()) == [True]
