"""Layer checkpointing enabled before convert() stays enabled: those layers recompute "full", the rest selective."""

import copy
import warnings
from contextlib import nullcontext

import pytest
import torch

from selective_ckpt import convert, set_recompute
from tests.models import hf_checks, test_gpt2, test_hf_llama
from tests.models.families import by_name
from tests.models.hf_checks import batch, kept_bytes_per_layer

transformers = pytest.importorskip("transformers")

BUILDS = {
    "gpt2": lambda n: test_gpt2.build(n_layer=n)(),
    "llama": lambda n: test_hf_llama.build(num_hidden_layers=n)(),
    "mistral": lambda n: by_name("mistral").build(num_hidden_layers=n)(),
    "qwen2": lambda n: by_name("qwen2").build(num_hidden_layers=n)(),
    "qwen3": lambda n: by_name("qwen3").build(num_hidden_layers=n)(),
}


def _modes(model):
    return [layer._selective_ckpt.recompute for layer in hf_checks._layers(model)]


def _enable(model, how):
    """Turns transformers' checkpointing on the way `how` names; the QLoRA recipe also adds LoRA adapters."""
    renamed = hasattr(model, "activation_checkpointing_enable")  # transformers' current name, where it has one
    if how == "activation_checkpointing_enable":
        if renamed:
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
    elif how == "gradient_checkpointing_enable":  # the name before the rename, still honoured with a FutureWarning
        with pytest.warns(FutureWarning, match="gradient_checkpointing_enable") if renamed else nullcontext():
            model.gradient_checkpointing_enable()
    elif how == "every_2":
        model.activation_checkpointing_enable(every_n_layers=2)
    else:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        # peft takes its k-bit path (freeze, reentrant checkpointing, input grads) on the flag a 4-bit
        # load sets; the Linears stay fp32 here, which changes nothing about the checkpointing
        model.is_loaded_in_4bit = True
        with warnings.catch_warnings():
            # peft 0.21's prepare_model_for_kbit_training calls transformers' gradient_checkpointing_enable, the
            # name transformers 5 deprecates; only that call of peft's, as this test of ours calls it too
            warnings.filterwarnings("ignore", message="`gradient_checkpointing_enable` is deprecated",
                                    category=FutureWarning)
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                    gradient_checkpointing_kwargs={"use_reentrant": True})
        torch.manual_seed(7)
        gpt2 = model.config.model_type == "gpt2"  # GPT-2's Conv1D holds its weight transposed: fan_in_fan_out
        targets = ["c_attn", "c_fc"] if gpt2 else ["q_proj", "v_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=gpt2,
                                                 init_lora_weights=False))
    return model


def _build(family, n, how=None, converted=True):
    torch.manual_seed(0)
    model = BUILDS[family](n).train()
    model.config._attn_implementation = "sdpa"
    if how is not None:
        model = _enable(model, how)
    return convert(model) if converted else model


HOWS = ["activation_checkpointing_enable", "every_2", "prepare_model_for_kbit_training"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("family", BUILDS)
def test_checkpointing_enabled_before_convert_stays(family, how):
    """Modes, the checkpoint function the user chose, and the same bits as enabling it after convert."""
    before = _build(family, 3, how)
    after = _enable(_build(family, 3), how)
    expected = ["full", "selective", "full"] if how == "every_2" else ["full"] * 3
    assert _modes(before) == _modes(after) == expected
    for a, b in zip(hf_checks._layers(before), hf_checks._layers(after)):
        assert a.gradient_checkpointing == b.gradient_checkpointing
        assert a._gradient_checkpointing_func.keywords == b._gradient_checkpointing_func.keywords
    ids, mask = batch()
    got, want = hf_checks._step(before, input_ids=ids, attention_mask=mask), hf_checks._step(after, input_ids=ids,
                                                                                            attention_mask=mask)
    assert torch.equal(got[0], want[0])
    assert set(got[1]) == set(want[1]) and got[1]
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n


@pytest.mark.parametrize("family", BUILDS)
def test_checkpointed_layers_keep_what_checkpointing_keeps(family):
    """Bytes kept per layer: enabling checkpointing before convert keeps what enabling it after convert keeps,
    at most what the unconverted checkpointed model keeps (the layer input), far below the selective floor."""
    ids, _ = batch(b=2, s=24, pad_rows=False)
    inputs = {"input_ids": ids}
    ours = kept_bytes_per_layer(lambda n: _build(family, n, "activation_checkpointing_enable"), inputs)
    after = kept_bytes_per_layer(lambda n: _enable(_build(family, n), "activation_checkpointing_enable"), inputs)
    plain = kept_bytes_per_layer(lambda n: _build(family, n, "activation_checkpointing_enable", converted=False),
                                 inputs)
    selective = kept_bytes_per_layer(lambda n: _build(family, n), inputs)
    assert ours == after
    assert ours <= plain
    assert 2 * ours < selective


@pytest.mark.parametrize("before", [True, False], ids=["before-convert", "after-convert"])
def test_the_name_before_the_rename_still_turns_layers_full(before):
    """transformers' gradient_checkpointing_enable, deprecated for activation_checkpointing_enable, does what
    the current name does (with transformers' FutureWarning where the current name exists)."""
    model = _build("llama", 2, "gradient_checkpointing_enable") if before else \
        _enable(_build("llama", 2), "gradient_checkpointing_enable")
    assert _modes(model) == ["full", "full"]
    assert all(layer.gradient_checkpointing for layer in hf_checks._layers(model))


def test_set_recompute_after_convert_still_changes_checkpointed_layers():
    model = _build("llama", 2, "activation_checkpointing_enable")
    set_recompute(model, "selective")
    assert _modes(model) == ["selective", "selective"]
    assert not any(layer.gradient_checkpointing for layer in hf_checks._layers(model))
    copy.deepcopy(model)


def test_full_asked_of_convert_is_said_and_checkpointing_switched_on_is_warned(caplog):
    """The first step says which modes the layers run: "full" that convert or set_recompute was asked for is
    an info line; "full" from transformers' checkpointing (before or after convert) is a warning naming the
    way back to selective recompute."""
    import logging

    ids, _ = batch()

    def first_step_messages(model):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="selective_ckpt"):
            model(input_ids=ids, labels=ids).loss.backward()
        return [(r.levelno, r.message) for r in caplog.records if r.name == "selective_ckpt"]

    torch.manual_seed(0)
    asked = convert(BUILDS["llama"](2).train(), recompute="full")
    said = first_step_messages(asked)
    assert [lvl for lvl, _ in said] == [logging.INFO] and '2 "full"' in said[0][1], said
    plan = convert(BUILDS["llama"](2).train())
    set_recompute(plan, ["full", "selective"])
    said = first_step_messages(plan)
    assert [lvl for lvl, _ in said] == [logging.INFO], said
    for before in (True, False):
        model = _build("llama", 2, "activation_checkpointing_enable") if before else _build("llama", 2)
        if not before:
            _enable(model, "activation_checkpointing_enable")
        said = first_step_messages(model)
        assert any(lvl == logging.WARNING and '2 "full"' in m and "gradient_checkpointing=False" in m
                   for lvl, m in said), (before, said)
