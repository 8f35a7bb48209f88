"""Offloading through the layers' own pipelines: SelectiveDecoderLayer stacks and converted Hugging Face models.

Gradients with a class offloaded equal, bit for bit, those of the same policy keeping it; the ledger's device and
host bytes per layer and class equal memory.estimate's split (the last layer's offload is never issued); with
simulated streams that run copies late and poison freed storage, a missing wait would show as NaN; a forward
without backward leaves nothing behind.
"""

import gc

import pytest
import torch
from torch import nn

from selective_ckpt import SelectiveDecoderLayer, convert, keeping, memory, set_recompute
from selective_ckpt.keeping.offload import OffloadEngine
from selective_ckpt.keeping.policy import CLASSES
from selective_ckpt.keeping.streams import SimulatedStreams
from selective_ckpt.registry import recomputable_layers

LAYERS = 3
SHAPES = {
    "llama": dict(hidden_dim=64, num_heads=4, num_kv_heads=2, ffn_dim=96, norm="rmsnorm", activation="swiglu",
                  rope_theta=10000.0, bias=False),
    "gpt": dict(hidden_dim=48, num_heads=4, mlp_ratio=4),
}
# every policy with something offloaded, beside the policy that keeps it
POLICIES = [keeping.policy("selective", offload=[c]) for c in CLASSES if c != "norm_act"] + [
    keeping.policy("selective", offload=[c for c in CLASSES if c != "norm_act"]),
    keeping.policy("none", offload=list(CLASSES)),
    keeping.policy("full", offload=["input"]),
]


def _stack(shape, dropout=0.1):
    torch.manual_seed(0)
    return nn.Sequential(*[SelectiveDecoderLayer(**SHAPES[shape], dropout=dropout, attn_dropout=dropout)
                           for _ in range(LAYERS)]).train()


def _step(model, x, seed=5):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    y = model(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(11), dtype=y.dtype)
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _assert_identical(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert not torch.isnan(u).any(), i
        assert torch.equal(u, v), i


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_layer_gradients_with_offload_equal_keeping(shape, policy):
    model = _stack(shape)
    x = torch.randn(2, 13, SHAPES[shape]["hidden_dim"])
    base = keeping.resolve(policy.recompute)
    set_recompute(model, base)
    expected = _step(model, x)
    for streams in (None, SimulatedStreams(delay=3)):
        engine = OffloadEngine(streams=streams, prefetch=1)
        set_recompute(model, policy, engine=engine)
        _assert_identical(_step(model, x), expected)
        engine.synchronize()
        gc.collect()
        assert engine.stats()["host_bytes_live"] == 0
        stats = engine.stats()
        assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] == stats["d2h_bytes"], stats


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_ledger_places_each_class_as_the_estimate_does(shape):
    policy = keeping.policy("selective", offload=["input", "mlp", "attention"])
    model = _stack(shape, dropout=0.0)
    set_recompute(model, policy)
    B, S = 2, 13
    x = torch.randn(B, S, SHAPES[shape]["hidden_dim"], requires_grad=True)
    report = memory.ledger(model, x)
    layer0 = model[0]
    kw = {k: v for k, v in SHAPES[shape].items() if k not in ("hidden_dim", "num_heads", "bias", "rope_theta")}
    for i, name in enumerate(report.by_layer):
        split = memory.estimate(layer0.hidden_dim, layer0.num_heads, S, B, torch.float32, recompute=policy,
                                breakdown="class-last" if i == LAYERS - 1 else "class", **kw)
        measured = report.by_class(layer=name)
        assert {c: v for c, v in measured.items() if v["device"] or v["host"]} == \
               {c: v for c, v in split.items() if v["device"] or v["host"]}, (name, report.table())
    assert report.host_bytes > 0 and report.device_bytes + report.host_bytes == report.total


def test_a_missing_wait_shows_as_nan():
    """The simulated streams poison what the engine frees early: a reload handed out before its copy ran is NaN."""
    model = _stack("llama", dropout=0.0)
    x = torch.randn(2, 13, 64)
    set_recompute(model, "selective")
    expected = _step(model, x)
    streams = SimulatedStreams(delay=50)
    engine = OffloadEngine(streams=streams, prefetch=0)
    set_recompute(model, keeping.policy("selective", offload=["mlp"]), engine=engine)
    _assert_identical(_step(model, x), expected)

    def skipped(stream, event):  # a reload returned without waiting for its copy
        return None
    streams.wait_event = skipped
    try:
        got = _step(model, x)
    finally:
        del streams.wait_event
    assert any(torch.isnan(g).any() for g in got[1:]), "the simulation did not catch the missing wait"


def test_forwards_without_backward_leave_nothing():
    model = _stack("llama", dropout=0.1)
    engine = OffloadEngine(streams=SimulatedStreams(delay=2))
    set_recompute(model, keeping.policy("selective", offload=["input", "mlp", "qkv"]), engine=engine)
    x = torch.randn(2, 13, 64, requires_grad=True)
    for _ in range(2):  # the first step sizes the arena, the second allocates it at that size
        model(x).sum().backward()
        gc.collect()
        engine.synchronize()
    before = engine.stats()
    assert before["host_capacity"] > 0
    for _ in range(100):
        model(x)  # evaluation with grad on: the graph is dropped unused
    gc.collect()
    engine.synchronize()
    stats = engine.stats()
    assert stats["host_bytes_live"] == 0 and stats["pending"] == 0 and stats["device_bytes"] == 0, stats
    assert stats["host_capacity"] == before["host_capacity"], stats
    assert stats["host_allocations"] == before["host_allocations"], stats


def test_deepcopy_keeps_the_policy_and_asks_for_an_engine():
    import copy

    model = _stack("gpt", dropout=0.0)
    set_recompute(model, keeping.policy("selective", offload=["mlp"]))
    twin = copy.deepcopy(model)
    assert twin[0].policy == model[0].policy and twin[0].engine is None
    with pytest.raises(RuntimeError, match="no offload engine"):
        twin(torch.randn(1, 5, 48, requires_grad=True))
    set_recompute(twin, twin[0].policy)
    twin(torch.randn(1, 5, 48, requires_grad=True)).sum().backward()


def test_set_recompute_shares_one_engine_and_checks_it():
    model = _stack("gpt", dropout=0.0)
    policies = set_recompute(model, keeping.policy("selective", offload=["mlp"]), prefetch=2)
    engines = {id(m.engine) for m in model}
    assert len(engines) == 1 and policies[0].offloaded == {"mlp"}
    with pytest.raises(TypeError, match="engine must be"):
        set_recompute(model, keeping.policy("selective", offload=["mlp"]), engine="cpu")
    with pytest.raises(ValueError, match="no policy offloads"):
        set_recompute(model, "selective", engine=OffloadEngine())
    assert set_recompute(model, "full", every=None) == ["full"] * LAYERS


# --- converted Hugging Face models

def _hf(family, form, tmp_path):
    from tests.models.families import by_name
    from tests.models.test_training_configs import build

    if family == "llama" and form != "fp32":
        model = build("llama", {"autocast-lora-dropout": "autocast-lora", "qlora": "qlora-dropout"}[form], 3,
                      tmp_path)
        if form == "autocast-lora-dropout":
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.05
        return model
    torch.manual_seed(0)
    return by_name(family).build(num_hidden_layers=3)().train()


def _hf_step(model, ids, form, seed=3):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if form.startswith("autocast") else torch.autocast("cpu",
                                                                                                         enabled=False)
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family, form", [("llama", "fp32"), ("llama", "autocast-lora-dropout"), ("llama", "qlora"),
                                          ("mixtral", "fp32"), ("gpt_neox", "fp32")])
def test_converted_gradients_with_offload_equal_keeping(family, form, tmp_path):
    model = convert(_hf(family, form, tmp_path))
    ids = torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(2))
    expected = {}
    for mode in ("selective", "none", "full"):
        set_recompute(model, mode)
        expected[mode] = _hf_step(model, ids, form)
    for policy in (keeping.policy("selective", offload=["input", "qkv", "attention", "residual", "mlp"]),
                   keeping.policy("none", offload=list(CLASSES)), keeping.policy("full", offload=["input"])):
        engine = OffloadEngine(streams=SimulatedStreams(delay=2))
        set_recompute(model, policy, engine=engine)
        _assert_identical(_hf_step(model, ids, form), expected[policy.recompute])
        assert engine.stats()["d2h_bytes"] > 0, policy


def test_converted_ledger_splits_device_and_host_as_the_estimate(tmp_path):
    from selective_ckpt.models.configuration import layer_estimate

    model = convert(_hf("llama", "fp32", tmp_path))
    policy = keeping.policy("selective", offload=["input", "mlp"])
    set_recompute(model, policy)
    ids = torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(2))
    report = memory.ledger(model, input_ids=ids, labels=ids)
    layers = recomputable_layers(model)
    names = [n for n in report.by_layer if n != "-"]
    assert len(names) == LAYERS
    for i, name in enumerate(names):
        parts = layer_estimate(layers[i], 17, 2, None, breakdown=True)
        split = keeping.split_parts(parts, policy, offloaded=i < LAYERS - 1)
        measured = report.by_class(layer=name)
        for cls in ("input", "mlp"):
            assert measured[cls] == split[cls], (name, cls, report.table())
        assert sum(v["host"] for v in measured.values()) == sum(v["host"] for v in split.values())


def test_packed_documents_with_offload_equal_keeping():
    """Documents packed into one row by position_ids (DataCollatorWithFlattening's form) under an offload policy."""
    from tests.models.families import by_name

    torch.manual_seed(0)
    model = convert(by_name("llama").build(num_hidden_layers=3)().train())
    ids = torch.randint(0, 90, (1, 22), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(9), torch.arange(5), torch.arange(8)])[None]

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, position_ids=positions, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    set_recompute(model, "selective")
    expected = step()
    set_recompute(model, keeping.policy("selective", offload=["input", "qkv", "attention", "residual", "mlp"]),
                  engine=OffloadEngine(streams=SimulatedStreams(delay=2)))
    _assert_identical(step(), expected)
