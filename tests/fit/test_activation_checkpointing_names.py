"""README.md and the examples use transformers' current names for its layer checkpointing ("activation
checkpointing"): a deprecated name appears only beside its current one, as what older transformers call it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# deprecated name (a pattern) -> its current name
RENAMED = {
    r"(?<![\w.])gradient_checkpointing_enable\b": "activation_checkpointing_enable",
    r"(?<![\w.])gradient_checkpointing_disable\b": "activation_checkpointing_disable",
    r"\bis_gradient_checkpointing\b": "is_activation_checkpointing",
    r"(?<!\w)gradient_checkpointing_kwargs\b": "activation_checkpointing_kwargs",
    r"(?<!\w)gradient_checkpointing\s*=": "activation_checkpointing=",
}
FILES = [ROOT / "README.md", *sorted((ROOT / "examples").glob("*.py"))]


def _paragraphs(path):
    return [p for p in re.split(r"\n\s*\n", path.read_text()) if p.strip()]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_deprecated_names_only_beside_the_current_ones(path):
    for paragraph in _paragraphs(path):
        for old, new in RENAMED.items():
            if re.search(old, paragraph):
                assert new in paragraph.replace("`", "").replace(" ", ""), \
                    f"{path.name}: {old!r} without {new!r} in:\n{paragraph}"


def test_the_current_names_are_transformers_own():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip("this transformers predates the activation checkpointing names")
    for name in ("activation_checkpointing_enable", "activation_checkpointing_disable", "is_activation_checkpointing"):
        assert hasattr(transformers.PreTrainedModel, name), name
    fields = transformers.TrainingArguments.__dataclass_fields__
    assert "activation_checkpointing" in fields and "activation_checkpointing_kwargs" in fields


def test_the_example_turns_checkpointing_off_by_the_current_name():
    import importlib.util

    transformers = pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("finetune_llama_lora", ROOT / "examples" / "finetune_llama_lora.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    off = example.checkpointing_off(transformers.TrainingArguments)
    current = "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
    assert off == ({"activation_checkpointing": False} if current else {"gradient_checkpointing": False})


def test_no_source_of_ours_reads_is_gradient_checkpointing():
    """pyproject.toml drops transformers' FutureWarning for `is_gradient_checkpointing`, which peft reads: that filter
    must hide nobody's but peft's, so neither the package nor its tests, examples and benchmarks read it."""
    sources = [p for d in ("selective_ckpt", "tests", "examples", "bench") for p in (ROOT / d).rglob("*.py")]
    readers = [p.relative_to(ROOT).as_posix() for p in sources if p != Path(__file__).resolve()
               and re.search(r"\bis_gradient_checkpointing\b", p.read_text())]
    assert not readers, readers
