"""recompute.py: outputs dropped inside a scope, rebuilt once for every consumer, exact gradients."""

import torch
import torch.nn.functional as F

from selective_ckpt import recompute


def _produce(x, calls):
    def rebuild(t):
        calls.append(1)
        return torch.tanh(t)
    y = torch.tanh(x)
    return recompute.discardable(y, rebuild, x), y


def test_one_rebuild_for_several_consumers_and_same_grads():
    torch.manual_seed(0)
    x = torch.randn(5, 7, requires_grad=True)
    ws = [torch.randn(3, 7, requires_grad=True) for _ in range(3)]
    calls = []
    with recompute.scope():
        y, _ = _produce(x, calls)
        out = sum(F.linear(y, w).sum() for w in ws) + F.linear(y[:, 1:4], ws[0][:, 1:4]).sum()
    assert calls == []
    out.backward()
    assert calls == [1]
    ref_x = x.detach().clone().requires_grad_(True)
    ref_ws = [w.detach().clone().requires_grad_(True) for w in ws]
    yr = torch.tanh(ref_x)
    (sum(F.linear(yr, w).sum() for w in ref_ws) + F.linear(yr[:, 1:4], ref_ws[0][:, 1:4]).sum()).backward()
    assert torch.equal(x.grad, ref_x.grad)
    for w, r in zip(ws, ref_ws):
        assert torch.equal(w.grad, r.grad)


def test_in_place_edit_is_saved_as_usual():
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    calls = []
    with recompute.scope():
        y, _ = _produce(x, calls)
        y2 = y.mul_(2)  # the version moved: the rebuild would be wrong, so y is saved itself
        F.linear(y2, w).sum().backward()
    assert calls == []
    torch.testing.assert_close(w.grad, (2 * torch.tanh(x.detach())).sum(0).expand(4, 4))


def test_no_scope_inside_other_saved_tensor_hooks():
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with recompute.scope() as s:
            assert s is None and not recompute.active()
    with torch.no_grad(), recompute.scope() as s:
        assert s is None
