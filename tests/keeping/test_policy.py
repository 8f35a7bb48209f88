"""keeping.policy: the three modes as policies, what can be combined, and how estimate parts split by class."""

import pytest
import torch

from selective_ckpt import keeping, memory
from selective_ckpt.keeping.policy import CLASSES, NAMED, PART_CLASSES, LayerPolicy, policy, resolve, split_parts


def test_modes_are_named_policies():
    assert NAMED["none"].rebuilt == frozenset()
    assert NAMED["selective"].rebuilt == {"norm_act"}
    assert NAMED["full"].rebuilt == frozenset(CLASSES) - {"input"}
    for mode, p in NAMED.items():
        assert p.recompute == mode and p == mode and resolve(mode) is p and not p.offloaded
        assert hash(p) == hash(mode)  # usable where modes were dict keys
    assert NAMED["selective"] != "none" and NAMED["selective"] != NAMED["none"]


def test_policy_offloads_the_kept_classes_asked():
    p = policy("selective", offload=["mlp", "attention"])
    assert p.offloaded == {"mlp", "attention"} and p.recompute == "selective" and p != "selective"
    assert str(p) == "selective, offload attention+mlp"
    assert policy("full", offload="input").offloaded == {"input"}
    assert policy("none", offload=list(CLASSES)).offloaded == set(CLASSES)
    assert p.action("other") == "keep" and p.action("norm_act") == "rebuild"
    tiled = policy("attention-kept", offload=["input"], mlp_tiles=8)
    assert str(tiled) == "attention-kept, offload input, MLP in 8 tiles" and tiled != policy("attention-kept")
    assert policy("full", mlp_tiles=1) == "full" and policy("full", mlp_tiles=2) != "full"


@pytest.mark.parametrize("make, message", [
    (lambda: policy("selective", offload=["norm_act"]), "norm_act is rebuilt"),
    (lambda: policy("full", offload=["mlp"]), "mlp is rebuilt"),
    (lambda: policy("selective", offload=["weights"]), "'weights' is not a class"),
    (lambda: policy("sometimes"), "recompute must be one of"),
    (lambda: policy("selective", offload=3), "offload must be a list"),
    (lambda: LayerPolicy(mlp="drop"), "mlp must be one of"),
    (lambda: LayerPolicy(input="rebuild"), "input cannot be rebuilt"),
    (lambda: LayerPolicy(qkv="rebuild"), "rebuilding norm_act, qkv is not supported"),
    (lambda: resolve(3), "policy must be a recompute mode"),
    (lambda: policy("selective", mlp_tiles=4), "mlp_tiles=4 runs the MLP again"),
    (lambda: policy("full", mlp_tiles=0), "mlp_tiles must be an int >= 1"),
])
def test_bad_policies_are_named(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def _parts(**kw):
    shape = dict(hidden_dim=64, num_heads=4, seq_len=17, batch=2, dtype=torch.bfloat16, num_kv_heads=2, ffn_dim=176,
                 norm="rmsnorm", activation="swiglu")
    return {**shape, **kw}


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_every_estimate_part_has_a_class(mode):
    moe = memory.MoE(num_experts=4, top_k=2, expert_dim=32, shared_dim=16)
    lora = memory.LoRA({"q_proj": 4}, dropout=0.1)
    small = {"norm_stats", "ln_stats", "qk_norm_stats", "post_norm_stats", "seeds", "lora_a_out", "lora_scaling",
             "lora_seeds", "router_probs", "router_indices", "routing_weights", "router_topk_sum",
             "router_topk_copy", "shared_sigmoid", "multipliers"}
    for kw in (dict(), dict(moe=moe, lora=lora, dropout=0.1, attn_dropout=0.1), dict(residual="post-norm",
               qk_norm="projection", scalar_multipliers=2), dict(post_norms=True, qk_norm=True),
               dict(norm="layernorm", activation="gelu")):
        parts = memory.estimate(**_parts(**kw), recompute=mode, breakdown=True)
        assert set(parts) <= set(PART_CLASSES) | small, set(parts) - set(PART_CLASSES) - small


def test_estimate_splits_by_class_and_residence():
    p = policy("selective", offload=["mlp", "input"])
    parts = memory.estimate(**_parts(), recompute=p, breakdown=True)
    split = memory.estimate(**_parts(), recompute=p, breakdown="class")
    last = memory.estimate(**_parts(), recompute=p, breakdown="class-last")
    assert split["mlp"] == {"device": 0, "host": parts["gate_out"] + parts["up_out"]}
    assert split["input"] == {"device": 0, "host": parts["x"]}
    assert split["attention"] == {"device": parts["o"] + parts["lse"], "host": 0}
    assert sum(v["device"] + v["host"] for v in split.values()) == sum(parts.values())
    assert all(v["host"] == 0 for v in last.values())  # the last layer's offload is never issued
    assert memory.estimate(**_parts(), recompute=p) == memory.estimate(**_parts(), recompute="selective")
    assert split_parts(parts, "selective")["mlp"]["host"] == 0
    with pytest.raises(ValueError, match="breakdown must be"):
        memory.estimate(**_parts(), recompute=p, breakdown="layer")


def test_keeping_exports():
    assert keeping.policy is policy and keeping.LayerPolicy is LayerPolicy
