"""recompute.py: outputs dropped inside a scope, rebuilt once for every consumer, exact gradients."""

import pytest
import torch
import torch.nn.functional as F

from selective_ckpt.keeping import pipeline as recompute


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


def test_a_saved_output_does_not_keep_its_graph_without_backward():
    """exp saves its own output; inside a scope that output must not hold its grad_fn in a cycle, or a forward
    never followed by backward (an evaluation with grad on, a skipped batch) would keep its graph forever."""
    import weakref

    x = torch.randn(6, 5, requires_grad=True)
    with recompute.scope():
        y = torch.exp(x)
    alive = weakref.ref(y)
    del y
    assert alive() is None
    with recompute.scope():
        y = torch.exp(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.exp(x.detach()))


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))


@pytest.mark.parametrize("backward", [False, True], ids=["forward only", "forward and backward"])
@pytest.mark.parametrize("name", ["llama", "smollm3"])
def test_a_training_forward_leaves_nothing_behind(name, backward):
    """Net CPU bytes of a converted model's training forward (bf16 autocast, LoRA with dropout, a padded batch;
    SmolLM3's sliding-window layer has its mask described) are zero once its output is dropped, with or without
    backward: no graph kept by a cycle, no mask kept by a cache into the next forward or the next test."""
    from selective_ckpt import convert
    from selective_ckpt.memory.peak import cpu_allocation_deltas
    from tests.models import hf_checks
    from tests.models.families import by_name

    pytest.importorskip("peft")
    torch.manual_seed(0)
    model = _lora(convert(by_name(name).build()().train()))
    ids, mask = hf_checks.batch(b=3, s=21)

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
        if backward:
            out.loss.backward()

    step()  # the first step creates the gradients, which stay
    deltas = cpu_allocation_deltas(step)
    if deltas is None:
        pytest.skip("the profiler's raw memory events are not available")
    assert sum(deltas) == 0
