"""The ops' direct eager path (ops/eager.py): the same bits as the dispatcher's path, which stays wherever it
decides something (dispatch modes, fake tensors, no autograd formula with gradients needed)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from selective_ckpt import rng
from selective_ckpt.ops import eager
from selective_ckpt.ops.attention import attention
from selective_ckpt.ops.rms_norm import rms_norm_apply, rms_norm_fwd


class _Passthrough(TorchDispatchMode):
    """Any dispatch mode: the ops take the dispatcher's path under it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _attention_step(q, k, v, seed):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = attention(q, k, v, True, 0.17, None, None, seed)
    o.backward(torch.linspace(-1, 1, o.numel()).reshape(o.shape))
    return o.detach(), q.grad, k.grad, v.grad


def test_direct_path_bit_identical_to_the_dispatcher(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 17, 16, generator=g)
    k, v = torch.randn(2, 2, 17, 16, generator=g), torch.randn(2, 2, 17, 16, generator=g)
    seed = rng.seed_arg(12345)
    calls = []
    real = eager.eager_ok
    monkeypatch.setattr(eager, "eager_ok", lambda args: calls.append(1) or real(args))
    direct = _attention_step(q, k, v, seed)
    assert calls  # the ops were called through the direct path check
    with _Passthrough():
        assert not eager.eager_ok((q,))
        dispatched = _attention_step(q, k, v, seed)
    for a, b in zip(direct, dispatched):
        assert torch.equal(a, b)


def test_rms_norm_direct_path_gradients_and_saved_tensors():
    x = torch.randn(3, 5, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    results = []
    for mode in (None, _Passthrough()):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            if mode is None:
                y, rstd = rms_norm_fwd(x, w, 1e-6, 0.0)
            else:
                with mode:
                    y, rstd = rms_norm_fwd(x, w, 1e-6, 0.0)
        assert type(y.grad_fn).__name__ != "NoneType"
        dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
        results.append((y.detach(), rstd, dx, dw, saved))
    (a, b) = results
    for ta, tb in zip(a[:4], b[:4]):
        assert torch.equal(ta, tb)
    assert a[4] == b[4]  # the same tensors saved, in the same order


def test_fake_and_meta_tensors_take_the_dispatcher():
    with FakeTensorMode():
        x = torch.empty(2, 8)
        y, rstd = rms_norm_fwd(x, torch.empty(8), 1e-6, 0.0)
    assert y.shape == (2, 8) and rstd.shape == (2,)
    y, rstd = rms_norm_fwd(torch.empty(2, 8, device="meta"), torch.empty(8, device="meta"), 1e-6, 0.0)
    assert y.device.type == "meta" and rstd.shape == (2,)


def test_op_without_autograd_formula_refuses_backward_as_before():
    x = torch.randn(2, 8, requires_grad=True)
    w = torch.randn(8)
    _, rstd = rms_norm_fwd(x.detach(), w, 1e-6, 0.0)
    y = rms_norm_apply(x, w, rstd, 0.0)  # gradients needed: the dispatcher's node, whose backward refuses
    with pytest.raises(RuntimeError, match="autograd"):
        y.sum().backward()
    with torch.no_grad():
        assert torch.equal(rms_norm_apply(x, w, rstd, 0.0), y.detach())


def test_mutated_argument_version_bumped():
    from selective_ckpt.ops.gelu_mlp import gelu_backward_op

    grad, h = torch.randn(3, 17), torch.randn(3, 17)
    before = grad._version
    gelu_backward_op(grad, h, "none")
    assert grad._version > before
