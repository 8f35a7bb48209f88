"""examples/finetune_llama_lora.py runs end to end (Trainer + PEFT LoRA, converted and not) in its quick form."""

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_llama_lora.py"


@pytest.mark.parametrize("extra", [[], ["--qlora"], ["--fp32", "--lora-dropout", "0"]])
def test_quick_run_prints_curves_and_bytes_per_layer(capsys, extra):
    if "--qlora" in extra:
        pytest.importorskip("bitsandbytes")
    spec = importlib.util.spec_from_file_location("finetune_llama_lora", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "3", "--seq", "32", "--batch", "4", "--layers", "2", *extra]) == 0
    out = capsys.readouterr().out
    assert "largest loss difference" in out
    rows = {line.split("  ")[1].strip(): line for line in out.splitlines() if "B/token" in line}
    assert set(rows) >= {"transformers (SDPA)", "selective_ckpt", "floor (estimate)"}

    def per_token(name):
        return float(re.search(r"\(\s*([\d.]+) B/token", rows[name]).group(1))

    # the converted layer keeps its configuration's floor, to the byte; transformers' keeps more
    assert per_token("selective_ckpt") == pytest.approx(per_token("floor (estimate)"), abs=0.05)
    assert per_token("transformers (SDPA)") > per_token("selective_ckpt")
    steps = [line for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 3]
    assert len(steps) == 3
    for line in steps[:1] if "0" not in extra else steps:  # with LoRA dropout only the first step shares masks
        _, a, b = line.split()
        assert abs(float(a) - float(b)) < (2e-2 if "--fp32" not in extra else 1e-3)
