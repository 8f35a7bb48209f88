"""python -m selective_ckpt.bench.hf: Hugging Face rows (as built, HF gradient checkpointing, converted)."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


ROWS = ("sdpa", "hf-ckpt", "selective")
TRAINING = ("autocast", "autocast-lora", "bf16-lora-dropout", "qlora", "qlora-dropout")


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "selective_ckpt.bench.hf", "--quick", "--repeats", "2", "--out", str(tmp_path),
           "--no-progress", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "results.csv") as f:
        return proc, list(csv.DictReader(f))


def test_quick_run_table_csv_and_floor(tmp_path):
    proc, results = _run(tmp_path, "--configs")
    rows = {(r["model"], r["row"]): r for r in results}
    assert len(rows) == len(results) and {r["config"] for r in results} == {"fp32"}
    assert set(rows) == {(m, r) for m in ("llama", "gpt2") for r in ("sdpa", "hf-ckpt", "selective")}
    for model in ("llama", "gpt2"):
        kept = {r: int(rows[(model, r)]["kept_bytes_per_layer"]) for r in ("sdpa", "hf-ckpt", "selective")}
        floor = int(rows[(model, "selective")]["floor_bytes_per_layer"])
        assert kept["selective"] == floor, model  # the converted layer keeps the floor, to the byte
        assert kept["hf-ckpt"] < kept["selective"] < kept["sdpa"], model
        for r in ("sdpa", "hf-ckpt", "selective"):
            row = rows[(model, r)]
            assert float(row["step_s_p20"]) <= float(row["step_s"]) <= float(row["step_s_p80"])
        assert float(rows[(model, "sdpa")]["vs_sdpa"]) == 1.0
        table = [line for line in proc.stdout.splitlines() if re.match(rf"{model} +fp32 +\d+ ", line)]
        assert len(table) == 3, proc.stdout


def test_training_configuration_rows_keep_the_estimate(tmp_path):
    """Each training configuration's rows: the converted layer keeps layer_estimate to the byte, transformers
    keeps more, its checkpointing less; step times with their spread, ratios to transformers' row."""
    proc, results = _run(tmp_path, "--models")
    rows = {(r["config"], r["row"]): r for r in results}
    assert set(rows) == {(c, r) for c in TRAINING for r in ROWS} and len(rows) == len(results)
    for config in TRAINING:
        kept = {r: int(rows[(config, r)]["kept_bytes_per_layer"]) for r in ROWS}
        floor = int(rows[(config, "selective")]["floor_bytes_per_layer"])
        assert kept["selective"] == floor, (config, kept, floor)
        assert kept["hf-ckpt"] < kept["selective"] < kept["sdpa"], (config, kept)
        for r in ROWS:
            row = rows[(config, r)]
            assert row["model"] == "llama"
            assert float(row["step_s_p20"]) <= float(row["step_s"]) <= float(row["step_s_p80"])
            assert 0 < float(row["vs_sdpa_p20"]) <= float(row["vs_sdpa_p80"])
        assert float(rows[(config, "sdpa")]["vs_sdpa"]) == 1.0
        table = [line for line in proc.stdout.splitlines() if re.match(rf"llama +{config} +\d+ ", line)]
        assert len(table) == 3, proc.stdout
