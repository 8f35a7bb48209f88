"""Layers with q/k norms before RoPE (per head: Qwen3, Gemma3; over the whole projection: OLMo2) keep Llama's floor:
the q/k projection outputs (the norms' inputs) and v, never the normed, rotated q and k attention reads, which are
rebuilt in backward; plus the norms' fp32 statistics. The rebuilt q and k are the forward's bits: every policy
gives the same gradients."""

import pytest
import torch

from selective_ckpt import convert, keeping, memory, set_recompute
from selective_ckpt.models.configuration import layer_estimate
from selective_ckpt.registry import recomputable_layers
from tests.models.families import by_name
from tests.models.hf_checks import batch, kept_bytes_per_layer

transformers = pytest.importorskip("transformers")

B, S = 2, 24
H, HKV, D = 4, 2, 16  # the family table's attention shape


def _model(name, layers, **kw):
    torch.manual_seed(0)
    model = by_name(name).build(num_hidden_layers=layers, **kw)().train()
    model.config._attn_implementation = "sdpa"
    return convert(model)


def _ids():
    return batch(b=B, s=S, pad_rows=False)[0]


def test_per_head_q_k_norms_keep_llamas_floor_plus_their_statistics():
    """A Qwen3 layer keeps exactly what a Llama layer of the same shape keeps, plus one fp32 rstd per head and token
    for each of its two norms: allocator deltas of a 2-layer minus a 1-layer model, and the ledger by class."""
    ids = _ids()
    qwen3 = kept_bytes_per_layer(lambda n: _model("qwen3", n), {"input_ids": ids})
    llama = kept_bytes_per_layer(lambda n: _model("llama", n, head_dim=D), {"input_ids": ids})
    assert qwen3 == llama + B * S * (H + HKV) * 4

    classes = {}
    for name in ("qwen3", "llama"):
        model = _model(name, 1)
        report = memory.ledger(lambda i, m=model: m(input_ids=i).logits, ids, model=model)
        layer = next(n for n in report.by_layer if n != "-")
        classes[name] = {c: v["device"] for c, v in report.by_class(layer).items()}
    assert classes["qwen3"]["qkv"] == classes["llama"]["qkv"] == B * S * (H + 2 * HKV) * D * 4
    assert classes["qwen3"].get("norm_act", 0) == 0
    assert classes["qwen3"]["other"] == classes["llama"]["other"] + B * S * (H + HKV) * 4


@pytest.mark.parametrize("name, kw", [("qwen3", {}), ("olmo2", {}), ("gemma3_text", {}),
                                      ("glm4_moe", {"use_qk_norm": True})],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_rotated_q_k_are_not_kept(name, kw):
    """What the ledger sees of q, k and v: the projection outputs the norms read and v (Llama's q/k/v bytes),
    nothing of the norms' or RoPE's outputs; and the layer keeps its estimate."""
    model = _model(name, 1, **kw)
    ids = _ids()
    report = memory.ledger(lambda i: model(input_ids=i).logits, ids, model=model)
    layer = next(n for n in report.by_layer if n != "-")
    classes = {c: v["device"] for c, v in report.by_class(layer).items()}
    assert classes["qkv"] == B * S * (H + 2 * HKV) * D * 4
    assert classes.get("norm_act", 0) == 0
    parts = layer_estimate(recomputable_layers(model)[0], S, B, breakdown=True)
    assert parts["qkv"] + parts["qk_norm_in"] == classes["qkv"]


def _grads(model, ids, dtype=None):
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


POLICIES = ("none", "selective", keeping.policy("selective", offload=["qkv"]))


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "gemma3_text"])
def test_every_policy_gives_the_same_bits(name):
    """The rebuilt q and k are those the forward computed: "none" (which keeps them), "selective" (which rebuilds
    them) and "selective" with q/k/v offloaded give bit-identical losses and gradients."""
    model = _model(name, 2)
    ids = _ids()
    runs = []
    for p in POLICIES:
        set_recompute(model, p)
        runs.append(_grads(model, ids))
    for loss, grads in runs[1:]:
        assert torch.equal(loss, runs[0][0])
        assert grads.keys() == runs[0][1].keys()
        assert all(torch.equal(grads[n], g) for n, g in runs[0][1].items())


def test_lora_on_q_k_under_autocast_keeps_the_estimate():
    """fp32 weights under bf16 autocast, LoRA on q_proj and k_proj (the LoRA sums are the norms' inputs): the layer
    keeps its estimate (the bf16 projection outputs, not RoPE's fp32 outputs nor attention's bf16 casts of them),
    and "none" and "selective" give the same bits."""
    from peft import LoraConfig, get_peft_model

    def build(n):
        torch.manual_seed(0)
        model = by_name("qwen3").build(num_hidden_layers=n)().train()
        model.config._attn_implementation = "sdpa"
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"],
                                                 init_lora_weights=False))
        return convert(model)

    ids = _ids()

    def held(n):
        model = build(n)

        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out.append(model(input_ids=ids, labels=ids).loss)
        out = []
        return sum(memory.cpu_allocation_deltas(forward))

    kept = held(2) - held(1)
    model = build(1)
    assert kept == layer_estimate(recomputable_layers(model)[0], S, B, torch.bfloat16)
    runs = []
    for p in ("none", "selective"):
        set_recompute(model, p)
        runs.append(_grads(model, ids, torch.bfloat16))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[1][1][n], g) for n, g in runs[0][1].items())
