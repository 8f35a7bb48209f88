"""selective_ckpt.fit.growth: a training step simulated at two long contexts grows only by what the policy keeps
(named classes), the working set of one layer or of the loss head, and what the step keeps once outside the
layers; and the walk does catch what grows faster than the context or is held by a layer outside its classes."""

import pytest
import torch

from selective_ckpt.fit import growth
from selective_ckpt.fit.configs import load_config
from selective_ckpt.fit.forms import TrainingForm

pytest.importorskip("transformers")
pytest.importorskip("peft")

LORA = TrainingForm("lora", autocast=torch.bfloat16)
QLORA = TrainingForm("qlora", autocast=torch.bfloat16)
# the classes each policy keeps (keeping.policy): the layer input, and under attention-kept attention's o and lse
KEPT = {"attention-kept": {"input", "attention"}, "full": {"input"}}


def _check(config, form, policy, contexts, num_layers=1):
    origins = growth.growing_allocations(config, form, contexts, policy, num_layers=num_layers)
    findings = [o.describe() for o in origins if o.kind == "grows"]
    assert not findings, growth.format_table(origins, contexts)
    classes = {c for o in origins if o.kind == "kept" for c in o.classes}
    assert classes == KEPT[policy], growth.format_table(origins, contexts)
    # what the step holds into backward outside the layers (the final norm's input, the loss head's gradient of
    # its input, the rotary tables and positions) is a couple of rows of h per token, at either context
    cfg = load_config(config)
    h, head_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * h * form.weights.itemsize + 2 * head_dim * 4 + 16
    shared = growth.summary(origins, contexts)["shared"]
    for s, held in zip(sorted(contexts), shared):
        assert 0 < held <= per_token * s, growth.format_table(origins, contexts)
    return origins


def test_llama_lora_grows_only_by_the_policy_at_moderate_contexts():
    """The fast tier's walk: the same rules at 8K and 32K tokens (the loss head loops over fewer chunks)."""
    origins = _check("Llama-3.1-8B", LORA, "attention-kept", (8192, 32768))
    kept = {o.largest.shape: o.classes for o in origins if o.kind == "kept"}
    # attention's o ([S, H, D] in the compute dtype) and lse ([H, S] float32): the policy's named bytes
    assert kept[1, 32768, 32, 128] == kept[1, 32, 32768] == ("attention",), kept


@pytest.mark.parametrize("config, form, policy", [
    ("Llama-3.1-8B", LORA, "attention-kept"),
    ("Llama-3.1-8B", QLORA, "attention-kept"),
    ("Llama-3.1-8B", QLORA, "full"),
    ("Mixtral-8x7B", LORA, "attention-kept"),
], ids=["llama-lora-attention-kept", "llama-qlora-attention-kept", "llama-qlora-full", "mixtral-lora-attention-kept"])
def test_long_contexts_grow_only_by_the_policy(config, form, policy):
    """At 128K and 512K tokens: nothing grows faster than the context, nothing a layer holds into backward is
    outside the policy's classes."""
    _check(config, form, policy, growth.CONTEXTS)


def _plant_square(model):
    """Each decoder layer makes (and drops) a [S, S] bool mask in its forward: quadratic in the context."""
    from selective_ckpt.fit.simulate import decoder_layers

    def hook(module, args, out):
        t = out[0] if isinstance(out, tuple) else out
        torch.ones(t.shape[1], t.shape[1], dtype=torch.bool)

    for layer in decoder_layers(model):
        layer.register_forward_hook(hook)


def _plant_stash(model):
    """Each decoder layer keeps a copy of its input on itself until the next step: linear in the context, held
    into backward by the layer outside any class its policy names."""
    from selective_ckpt.fit.simulate import decoder_layers

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        module.stash = x.detach().clone()

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("plant, exponent", [(_plant_square, 2.0), (_plant_stash, 1.0)], ids=["square", "stash"])
def test_the_walk_catches_a_planted_allocation(plant, exponent):
    contexts = (2048, 8192)
    origins = growth.growing_allocations("Llama-3.1-8B", LORA, contexts, "attention-kept", num_layers=1, plant=plant)
    findings = [o for o in origins if o.kind == "grows"]
    assert len(findings) == 1, growth.format_table(origins, contexts)
    assert findings[0].exponent == pytest.approx(exponent, abs=0.01)
    assert "test_growth.py:hook" in findings[0].where


def test_command_line_lists_the_kinds_and_exits_zero_without_findings(capsys):
    assert growth.main(["Llama-3.1-8B", "--form", "lora", "--autocast", "bfloat16", "--contexts", "4k,8k",
                        "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept as attention" in out and "shared" in out and "0 finding(s)" in out
