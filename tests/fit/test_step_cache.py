"""Simulated steps kept on disk (fit/step_cache.py): a second fit of the same model and form reads them and simulates
nothing, getting the same steps to the byte; anything a step depends on makes another key; "off" keeps nothing; an
entry that cannot be read is simulated again."""

import json

import pytest
import torch

from selective_ckpt.fit import TrainingForm, simulate, step_cache
from selective_ckpt.fit.arithmetic import _Model, _Projection

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

FORM = TrainingForm("lora", rank=4, autocast=torch.bfloat16, targets=("q_proj", "v_proj"))


def _config(**changes):
    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=4, max_position_embeddings=4096)
    return transformers.LlamaConfig(**{**sizes, **changes})


def _key(config=None, form=FORM, kinds=("none", "selective", "full"), batch=1, seq_len=256, layers=2,
         layer_types=None):
    return step_cache.key(config or _config(), form, kinds, batch, seq_len, layers, layer_types)


def test_a_second_fit_reads_the_steps_and_simulates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(step_cache.CACHE_ENV, str(tmp_path))
    first = _Projection(_Model(_config(), FORM), 1)
    first.simulate(256)
    steps = {kind: first.layered(kind, 256) for kind in ("transformers", "selective", "full")}
    class_bytes = {mode: first.model.class_bytes(mode) for mode in ("selective", "full")}
    assert len(list(tmp_path.glob("*.json"))) == 4  # transformers' and ours' runs, each with 1 and 2 layers

    def no_simulation(*args, **kwargs):
        raise AssertionError("a step was simulated although it was on disk")

    monkeypatch.setattr(simulate, "run_step", no_simulation)
    second = _Projection(_Model(_config(), FORM), 1)
    second.simulate(256)
    for kind, layered in steps.items():
        again = second.layered(kind, 256)
        assert (again.one, again.two) == (layered.one, layered.two), kind
    assert {mode: second.model.class_bytes(mode) for mode in class_bytes} == class_bytes


def test_the_key_changes_with_what_a_step_depends_on(monkeypatch):
    monkeypatch.delenv("SELECTIVE_CKPT_ATTENTION", raising=False)
    base = _key()
    assert _key() == base  # the same run, the same key
    config = _config()
    config._attn_implementation = "eager"
    others = [_key(config=_config(hidden_size=128)), _key(config=_config(rms_norm_eps=1e-5)), _key(config=config),
              _key(form=TrainingForm("lora", rank=8, autocast=torch.bfloat16, targets=("q_proj", "v_proj"))),
              _key(form=TrainingForm("qlora", rank=4, targets=("q_proj", "v_proj"))),
              _key(kinds=("none",)), _key(batch=2), _key(seq_len=512), _key(layers=1),
              _key(layer_types=["full_attention"])]
    monkeypatch.setenv("SELECTIVE_CKPT_ATTENTION", "ours")
    others.append(_key())
    monkeypatch.setattr(step_cache, "_versions", lambda: ("2.0.0", "4.0.0", None))  # another torch, no peft
    others.append(_key())
    monkeypatch.setattr(step_cache, "_package_source", lambda: "0" * 64)  # a line of this package changed
    others.append(_key())
    assert len(set(others)) == len(others) and base not in others


def test_off_keeps_nothing_and_an_unreadable_entry_is_simulated_again(tmp_path, monkeypatch):
    monkeypatch.setenv(step_cache.CACHE_ENV, "off")
    assert step_cache.directory() is None
    step = simulate.Step(1, 2, 3, {"embedding": (0, 4), ("forward", 0): (4, 9)}, 5)
    step_cache.store("name", ("selective",), {"selective": step}, {})
    assert step_cache.load("name", ("selective",)) is None
    monkeypatch.setenv(step_cache.CACHE_ENV, str(tmp_path / "cache"))
    step_cache.store("name", ("selective",), {"selective": step}, {"selective": {"qkv": 1.5}})
    assert step_cache.load("name", ("selective",)) == ({"selective": step}, {"selective": {"qkv": 1.5}})
    assert step_cache.load("name", ("selective", "full")) is None  # an entry of other kinds is not this one's
    (tmp_path / "cache" / "name.json").write_text(json.dumps({"steps": [{"weights": 1}]}))
    assert step_cache.load("name", ("selective",)) is None
    (tmp_path / "cache" / "name.json").write_text("{not json")
    assert step_cache.load("name", ("selective",)) is None
    monkeypatch.delenv(step_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert step_cache.directory() == tmp_path / "xdg" / "selective_ckpt" / "fit"
