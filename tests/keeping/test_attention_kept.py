"""The attention-kept policy: the layer runs again in backward except attention's forward.

Gradients equal selective's bit for bit (the same kernels run; the re-run replays the RNG state and autocast);
attention's forward runs once per layer and step; what a layer keeps is its input, attention's output and its
logsumexp (the ledger, allocator deltas and memory.estimate agree); the layer input can be offloaded on top.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from selective_ckpt import SelectiveDecoderLayer, convert, keeping, memory, set_recompute
from selective_ckpt.keeping.offload import OffloadEngine
from selective_ckpt.keeping.streams import SimulatedStreams
from selective_ckpt.memory.peak import cpu_allocation_deltas
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers

LLAMA = dict(hidden_dim=64, num_heads=4, num_kv_heads=2, ffn_dim=96, norm="rmsnorm", activation="swiglu",
             rope_theta=10000.0, bias=False)


class _AttentionCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.forward += name.startswith("selective_ckpt.attention_fwd")
        self.backward += name.startswith("selective_ckpt.attention_bwd")
        return func(*args, **(kwargs or {}))


def _stack(n=3, dropout=0.1):
    torch.manual_seed(0)
    return nn.Sequential(*[SelectiveDecoderLayer(**LLAMA, dropout=dropout, attn_dropout=dropout)
                           for _ in range(n)]).train()


def _step(model, x, seed=4):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9)))
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def test_gradients_equal_selective_and_attention_runs_once():
    model = _stack()
    x = torch.randn(2, 21, 64)
    set_recompute(model, "selective")
    expected = _step(model, x)
    for policy in ("attention-kept", keeping.policy("attention-kept", offload=["input"])):
        set_recompute(model, policy, engine=OffloadEngine(streams=SimulatedStreams()) if policy != "attention-kept"
                      else None)
        with _AttentionCalls() as calls:
            got = _step(model, x)
        assert calls.forward == 3 and calls.backward == 3, (calls.forward, calls.backward)
        for a, b in zip(expected, got):
            assert torch.equal(a, b)
    set_recompute(model, "full")
    with _AttentionCalls() as calls:
        _step(model, x)
    assert calls.forward == 6  # whole-layer recompute runs attention's forward twice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_bytes_are_input_output_and_logsumexp(dtype):
    B, S = 2, 21
    model = _stack(dropout=0.1).to(dtype)
    set_recompute(model, "attention-kept")
    x = torch.randn(B, S, 64, dtype=dtype, requires_grad=True)
    report = memory.ledger(model, x)
    e = torch.finfo(dtype).bits // 8
    per_layer = B * S * 64 * e * 2 + B * 4 * S * 4  # x, o; the fp32 logsumexp
    assert list(report.by_layer.values()) == [per_layer] * 3, report.table()
    assert {e.kind for e in report.entries} == {"input", "attention"}
    est = memory.estimate(64, 4, S, B, dtype, recompute="attention-kept", num_kv_heads=2, ffn_dim=96,
                          norm="rmsnorm", activation="swiglu")
    assert est == per_layer
    held = []
    for n in (1, 3):  # what the allocator holds after a forward, the rebuild active
        m = _stack(n).to(dtype)
        set_recompute(m, "attention-kept")
        out = []
        held.append(sum(cpu_allocation_deltas(lambda m=m, out=out: out.append(m(x)))))
    # and the three dropout seeds (8 bytes each), which the checkpoint holds as arguments, as under "full"
    assert (held[1] - held[0]) / 2 == per_layer + 3 * 8


def test_estimate_and_flops():
    kw = dict(num_kv_heads=2, ffn_dim=96, norm="rmsnorm", activation="swiglu")
    full = memory.recompute_flops(64, 4, 4096, 1, recompute="full", **kw)
    kept = memory.recompute_flops(64, 4, 4096, 1, recompute="attention-kept", **kw)
    attention = memory.forward_flops(64, 4, 4096, 1, **kw) - memory.forward_flops(64, 4, 4096, 1, attention=False,
                                                                                      **kw)
    assert attention > 0 and full - kept == attention
    split = memory.estimate(64, 4, 13, 2, torch.bfloat16, recompute=keeping.policy("attention-kept",
                                                                                    offload="input"),
                            breakdown="class", **kw)
    assert split["input"]["host"] == 2 * 13 * 64 * 2 and split["attention"]["host"] == 0
    with pytest.raises(ValueError, match="attention cannot be offloaded"):
        keeping.policy("attention-kept", offload=["attention"])


@pytest.mark.parametrize("form", ["fp32", "autocast-lora-dropout", "qlora"])
def test_converted_llama_bit_identical_and_at_its_floor(form, tmp_path):
    from tests.keeping.test_layer_offload import _hf, _hf_step

    model = convert(_hf("llama", form, tmp_path))
    ids = torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(2))
    set_recompute(model, "selective")
    expected = _hf_step(model, ids, form)
    set_recompute(model, "attention-kept")
    assert all(s._selective_ckpt.recompute == "attention-kept" for s in recomputable_layers(model))
    with _AttentionCalls() as calls:
        got = _hf_step(model, ids, form)
    assert calls.forward == 3
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    # transformers' own checkpointing switched on afterwards reads as "full", and off again as selective
    if hasattr(model, "activation_checkpointing_enable"):  # the older name warns where this one exists
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    assert recomputable_layers(model)[0]._selective_ckpt.recompute == "full"
    set_recompute(model, "selective")
    assert recomputable_layers(model)[0]._selective_ckpt.recompute == "selective"


def test_converted_kept_bytes_equal_the_estimate():
    ids = torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(2))
    held = []
    for n in (1, 3):
        torch.manual_seed(0)
        from tests.models.families import by_name

        model = convert(by_name("llama").build(num_hidden_layers=n, use_cache=False)().train())
        set_recompute(model, "attention-kept")
        model(input_ids=ids, labels=ids)  # first calls change state once
        out = []
        held.append(sum(cpu_allocation_deltas(lambda m=model, out=out: out.append(m(input_ids=ids, labels=ids).loss))))
    per_layer = (held[1] - held[0]) / 2
    # transformers' checkpoint preserves the RNG state: a copy of the CPU generator's state per layer (host memory on
    # a GPU, as under "full" and transformers' own checkpointing)
    rng_state = torch.get_rng_state().numel()
    assert per_layer == layer_estimate(recomputable_layers(model)[1], 17, 2, None) + rng_state
