"""Casts the graph alone shows after a first watched call (keeping.pipeline.scope's memo): a cast of a view
(permute, transpose, view) of a tensor tagged inside its own op, and a cast made by `pipeline.cast` (a frozen
weight's, which has no graph node); rebuilt without the watcher, with the gradients of a run that watches."""

import torch
import torch.nn.functional as F

from selective_ckpt.keeping import pipeline


class _Tagged(torch.autograd.Function):
    """Stands for an op that tags its output inside its own forward (attention's o): no node yet then."""

    @staticmethod
    def forward(ctx, x):
        out = x * 3
        pipeline.tag(out, "attention")
        return out

    @staticmethod
    def backward(ctx, g):
        return g * 3


def _spy(monkeypatch):
    packed = []
    real = pipeline._LayerPipeline.pack

    def pack(self, t):
        r = real(self, t)
        packed.append((t.dtype, t.shape, isinstance(r, pipeline._View)))
        return r
    monkeypatch.setattr(pipeline._LayerPipeline, "pack", pack)
    return packed


def _viewed_step(x, w, memo, dims=(1, 2)):
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pipeline.scope("selective", layer_input=x, watch_casts=True, memo=memo):
            o = _Tagged.apply(x.to(torch.bfloat16))  # (B, S, H, D), bf16, kept
            # a view of o when dims=(1, 2); else reshape copies, and the graph shows a cast of that copy, which
            # only the watcher knows
            flat = o.permute(0, 2, 1, 3).transpose(*dims).reshape(2, 5, 12)
            out = flat.float() * w  # a float32 cast of the view, saved by the product for w's gradient
    out.float().sum().backward()
    return x.grad, w.grad


def test_cast_of_a_view_of_a_tagged_output_is_followed_by_the_graph(monkeypatch):
    packed = _spy(monkeypatch)
    x = torch.randn(2, 5, 4, 3)
    w = torch.nn.Parameter(torch.randn(12))
    memo, grads = {}, []
    for _ in range(3):
        packed.clear()
        w.grad = None
        grads.append(_viewed_step(x, w, memo))
        casts = [rebuilt for dtype, shape, rebuilt in packed if dtype == torch.float32 and shape == (2, 5, 12)]
        assert casts and all(casts), packed  # the float32 copy is rebuilt from o, watched or not
    assert list(memo.values()) == [False]
    w.grad = None
    plain = _viewed_step(x, w, None)
    for g in grads:
        assert torch.equal(g[0], plain[0]) and torch.equal(g[1], plain[1])


def test_cast_of_a_copy_keeps_the_watcher():
    x = torch.randn(2, 5, 4, 3)
    w = torch.nn.Parameter(torch.randn(12))
    memo = {}
    grads = [_viewed_step(x, w, memo, dims=(2, 3)) for _ in range(2)]
    assert list(memo.values()) == [True]
    w.grad = None
    plain = _viewed_step(x, w, None, dims=(2, 3))
    w.grad = None
    assert torch.equal(grads[1][0], plain[0])


def _frozen_step(x, w, a, memo):
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pipeline.scope("selective", layer_input=x, watch_casts=True, memo=memo):
            y = pipeline.discardable(x * 2, torch.mul, x, 2)
            base = F.linear(y, pipeline.cast(w, torch.bfloat16))  # the frozen weight cast as autocast would
            out = base + F.linear(y, a)
    out.float().sum().backward()
    return x.grad, a.grad


def test_a_shown_cast_of_a_frozen_weight_needs_no_watcher(monkeypatch):
    packed = _spy(monkeypatch)
    x = torch.randn(4, 8)
    w = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)
    a = torch.nn.Parameter(torch.randn(16, 8))
    memo, grads = {}, []
    for _ in range(3):
        packed.clear()
        a.grad = None
        grads.append(_frozen_step(x, w, a, memo))
        weights = [rebuilt for dtype, shape, rebuilt in packed if dtype == torch.bfloat16 and shape == (8, 16)]
        assert weights == [True, True], packed  # both weights' casts (transposed) rebuilt from the parameters
    assert list(memo.values()) == [False]
    for g in grads[1:]:
        assert torch.equal(g[0], grads[0][0]) and torch.equal(g[1], grads[0][1])
