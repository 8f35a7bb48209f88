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


def test_quick_run_table_csv_and_floor(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "selective_ckpt.bench.hf", "--quick", "--repeats", "2", "--out", str(tmp_path),
           "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "results.csv") as f:
        rows = {(r["model"], r["row"]): r for r in csv.DictReader(f)}
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
        table = [line for line in proc.stdout.splitlines() if re.match(rf"{model} +\d+ ", line)]
        assert len(table) == 3, proc.stdout
