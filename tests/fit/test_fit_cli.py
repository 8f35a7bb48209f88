"""python -m selective_ckpt.fit as a newcomer meets it: sizes, card names and contexts as people write them, every
default and what "max" means in --help, errors in one line naming the flag (in GiB, with the way out), one line
naming the extra when transformers is missing, no third-party noise on stderr, and an answer that ends with the
calls that apply it in lines of at most 100 columns."""

import subprocess
import sys

import pytest

from selective_ckpt.fit import TrainingForm, fit
from selective_ckpt.fit.__main__ import GPUS, main, parse_bytes, parse_seq_len
from selective_ckpt.fit.configs import MissingExtra

GIB, MIB = 2 ** 30, 2 ** 20


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80e9), ("80 GB", 80e9), ("80gb", 80e9), ("24GiB", 24 * GIB), ("141e9", 141e9), ("0.5TB", 0.5e12),
    ("H100", 81559 * MIB), ("H100-80GB", 81559 * MIB), ("h100 80gb", 81559 * MIB), ("H200", 143771 * MIB),
    ("A100-80GB", 81920 * MIB), ("A100-40GB", 40960 * MIB), ("RTX-4090", 24564 * MIB), ("RTX4090", 24564 * MIB),
    ("L4", 23034 * MIB), ("A10G", 23028 * MIB), ("L40S", 46068 * MIB)])
def test_gpu_sizes_and_cards(text, expected):
    assert parse_bytes(text) == int(expected)


def test_every_card_has_its_reported_memory():
    assert set(GPUS) >= {"H100-80GB", "A100-80GB", "A100-40GB", "H200", "RTX-4090", "L4", "A10G", "L40S", "H100"}
    for name in GPUS:
        assert parse_bytes(name) == GPUS[name] * MIB


@pytest.mark.parametrize("text", ["80 furlongs", "GB", "", "-80GB", "0GB", "A100"])
def test_a_bad_gpu_names_the_flag(text):
    with pytest.raises(ValueError, match="--gpu"):
        parse_bytes(text)


@pytest.mark.parametrize("text, expected", [("8k", 8192), ("8K", 8192), ("128K", 131072), ("131072", 131072),
                                            ("1.5k", 1536), ("max", "max"), ("MAX", "max"), ("1M", 1 << 20)])
def test_seq_len_in_tokens_and_k(text, expected):
    assert parse_seq_len(text) == expected


@pytest.mark.parametrize("text", ["8x", "0", "1.3k", "-5", "", "eight"])
def test_a_bad_seq_len_names_the_flag(text):
    with pytest.raises(ValueError, match="--seq-len"):
        parse_seq_len(text)


def test_help_shows_every_default_and_what_max_means(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for default in ("--batch BATCH", "(default: 1)", "(default: max)", "(default: full)", "(default: float32)",
                    "(default: none)", "(default: 16)", "(default: 0.0)", "q_proj, k_proj"):
        assert default in text, default
    for said in ("longest context", "80GB is 80e9 bytes", "nvidia-smi", "K = 1024", "128K", 'selective_ckpt[hf]'):
        assert said in " ".join(text.split()), said


def test_a_bad_flag_is_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["Llama-3.1-8B", "--gpu", "80GB", "--seq-len", "8x"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--seq-len" in err and "'8x'" in err, err


def test_weights_over_the_gpu_say_so_in_gib_with_the_way_out(capsys):
    """Forgetting --form on 80 GB: the weights and AdamW state of a full fp32 fine-tune do not fit; the flag, both
    sizes in GiB and the forms that would fit (--gpu given as two words, as people type it)."""
    assert main(["Llama-3.1-8B", "--gpu", "80", "GB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("error: --gpu 80GB (74.5 GiB) holds less than the weights and optimizer state alone "
                        "(89.7 GiB) for --form full: try --form lora or --form qlora"), err
    with pytest.raises(ValueError, match=r"gpu_bytes: .*\(74\.5 GiB\).*\(89\.7 GiB\).*TrainingForm\('lora'\)"):
        fit("Llama-3.1-8B", 80e9, seq_len=4096)


def test_without_transformers_it_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an import finds when it is not installed
    assert main(["Llama-3.1-8B", "--gpu", "80GB"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "transformers" in err and 'pip install "selective_ckpt[hf]"' in err, err
    with pytest.raises(MissingExtra, match=r"transformers.*selective_ckpt\[hf\]"):
        fit("Llama-3.1-8B", 80e9)
    assert issubclass(MissingExtra, ImportError)


def test_lora_without_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingExtra, match=r"peft.*selective_ckpt\[hf\]"):
        fit("Llama-3.1-8B", 80e9, form=TrainingForm("lora"))


@pytest.fixture(scope="module")
def cli():
    """The one command-line run (2-3 min on 2 cores, most of it the longest-context search): QLoRA, the form of
    test_fit_longest's Llama case and of the other Llama-3.1-8B fits here, whose steps a test session simulates once
    (tests/conftest.py)."""
    return subprocess.run([sys.executable, "-m", "selective_ckpt.fit", "Llama-3.1-8B", "--gpu", "80GB", "--form",
                           "qlora", "--seq-len", "4096"],
                          capture_output=True, text=True, timeout=600)


def test_no_third_party_noise_on_stderr(cli):
    """bitsandbytes, which nothing of the fit needs, is not imported: its CPU kernel line is not printed."""
    assert cli.returncode == 0, cli.stderr
    assert "gemm_4bit" not in cli.stderr and "kernels-community" not in cli.stderr, cli.stderr


def test_the_answer_ends_with_the_calls_that_apply_it(cli):
    lines = cli.stdout.rstrip("\n").split("\n")
    assert max(len(x) for x in lines) <= 100, max(lines, key=len)
    text = cli.stdout
    for column in ("kept per layer", "kept outside layers", "loss head transient", "layer backward transient",
                   "allocator share", "longest context"):
        assert column in text, column
    assert "head tr." not in text and "bwd tr." not in text
    for part in ("weights", "gradients", "optimizer state", "transformers + gradient checkpointing", "ours plan",
                 "not modelled"):
        assert part in text, part
    tail = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("recommendation"))):])
    assert tail == "\n".join(lines[-len(tail.split("\n")):])
    assert "selective_ckpt.convert(model" in tail and "activation_checkpointing=False" in tail
    assert "prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)" in tail  # QLoRA's


def test_the_trainer_flag_names_the_autocast_precision():
    """The recommendation's Trainer flags carry bf16=True / fp16=True for autocast over float32 weights, nothing for
    weights stored in 16 bits (Trainer's flags are for mixed precision)."""
    import torch

    from selective_ckpt.fit.report import _precision

    assert _precision(TrainingForm("lora", autocast=torch.bfloat16)) == ", bf16=True"
    assert _precision(TrainingForm("full", autocast=torch.float16)) == ", fp16=True"
    assert _precision(TrainingForm("qlora")) == ""
    assert _precision(TrainingForm("full", weights=torch.bfloat16, autocast=torch.bfloat16)) == ""


def test_a_plan_that_does_not_fit_is_not_called_unmodelled(tmp_path):
    """Where no plan fits the budgets the plan row says it does not fit, and the line below says why without
    calling the plan "not modelled" (that is for what the fit cannot simulate)."""
    from transformers import LlamaConfig

    from selective_ckpt.fit.report import report

    path = tmp_path / "config.json"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048).to_json_file(path)
    r = fit(str(path), 4 * MIB, seq_len=2048, form=TrainingForm("full"), host_bytes=0)
    assert r.max_context["ours plan"] < 2048 and r.variants["ours plan"].unfit
    text = report(r)
    assert "ours plan                             does not fit (below)" in text
    line = next(x for x in text.split("\n") if x.startswith("ours plan: "))
    assert line.startswith("ours plan: no plan fits") and "not modelled" not in line


@pytest.mark.parametrize("module, argv", [("selective_ckpt.bench.fit_check", ["Llama-3.1-8B"]),
                                          ("selective_ckpt.bench.offload", ["Llama-3.1-8B"]),
                                          ("selective_ckpt.bench.python_tax", []),
                                          ("selective_ckpt.bench.hf", ["--quick"]),
                                          ("selective_ckpt.fit.growth", ["Llama-3.1-8B"])])
def test_every_entry_point_that_needs_transformers_names_the_extra(module, argv, monkeypatch, capsys):
    import importlib

    from selective_ckpt.fit.configs import exit_code

    entry = importlib.import_module(module)
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert exit_code(lambda: entry.main(argv), f"python -m {module}") == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs transformers" in err and 'pip install "selective_ckpt[hf]"' in err, err
