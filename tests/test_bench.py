"""The main job `python -m selective_ckpt.bench` and the one-shot GPU script bench/gpu.sh.

The quick config runs as a user would run it (a subprocess); its kept-bytes column is checked
against memory.estimate and against hand counts of the eager rows, not against the ledger itself.
"""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selective_ckpt import bench, memory

ROOT = Path(__file__).resolve().parent.parent


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "selective_ckpt.bench", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    return proc, out, rows


def test_quick_run_prints_the_table_and_writes_csv(quick_run):
    proc, out, rows = quick_run
    cfg = bench.CONFIGS["quick"]
    assert set(cfg["rows"]) == set(bench.ROWS) - set(bench.COMPILED_ROWS)  # --quick skips only the compiled rows
    for row in cfg["rows"]:
        label = bench.ROW_LABELS[row]
        found = [line for line in proc.stdout.splitlines() if re.match(rf"\d+ +{re.escape(label)}  ", line)]
        assert len(found) == len(cfg["seqs"]), label
    assert "selective keeps" in proc.stdout and "the SDPA layer under torch checkpoint" in proc.stdout
    assert "Llama selective keeps" in proc.stdout and "Llama rows: kv_heads=" in proc.stdout
    # the header names the CPU and the ISA the C++ kernels picked; --quick says its times are noise, first
    assert re.search(r"^cpu=.+ cpp_kernels_isa=(avx512bf16|avx512|avx2|generic)$", proc.stdout, re.M), proc.stdout[:500]
    caveat = [i for i, line in enumerate(proc.stdout.splitlines()) if line.startswith("--quick: ")]
    first_ratio = next(i for i, line in enumerate(proc.stdout.splitlines()) if line.startswith("seq 64: selective"))
    assert caveat and caveat[0] < first_ratio and "noise" in proc.stdout.splitlines()[caveat[0]]
    # every ratio column says which row it divides by
    assert "ratios are to rows of this table at the same seq" in proc.stdout
    assert "time vs eager" in proc.stdout and "kept vs eager" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].endswith(f" to {out.resolve()}")
    assert {(int(r["seq"]), r["row"]) for r in rows} == {(s, k) for s in cfg["seqs"] for k in cfg["rows"]}
    assert len(rows) == len(cfg["seqs"]) * len(cfg["rows"])
    for r in rows:  # where and when: every row carries the environment
        assert r["timestamp"] and r["torch"] == torch.__version__ and r["selective_ckpt"] and int(r["threads"]) >= 1
        assert float(r["step_s_p20"]) <= float(r["step_s"]) <= float(r["step_s_p80"])
    # progress on stderr: the bar (tqdm) or plain lines
    assert "ledger" in proc.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in proc.stdout
    else:
        for name in ("kept_memory.png", "step_time.png", "tradeoff.png"):
            assert (out / name).stat().st_size > 0, name
    for r in rows:
        assert r["process"] == "main" and r["quick"] == "1"
        assert r["cpp_kernels_isa"] in ("avx512bf16", "avx512", "avx2", "generic")
        base = "llama-sdpa@main" if r["row"].startswith("llama") else "sdpa@main"
        assert r["ratio_base_sdpa"] == base, r


def test_quick_run_kept_bytes_match_independent_counts(quick_run):
    _, _, rows = quick_run
    cfg = bench.CONFIGS["quick"]
    h, a, b, e = cfg["hidden"], cfg["heads"], cfg["batch"], 4
    for r in rows:
        s, kept = int(r["seq"]), int(r["kept_bytes_per_layer"])
        t = s * b
        kv, ffn, D = bench.llama_kv_heads(a, "cpu")[0], int(bench.LLAMA_FFN_RATIO * h), h // a
        if r["row"] in memory.MODES:
            assert kept == memory.estimate(h, a, s, b, torch.float32, recompute=r["row"]), r
        elif r["row"] == "llama-selective":  # x, q, k/v at kv heads, o, x1, gate, up + lse + two rstd
            assert kept == t * (h + h + 2 * kv * D + h + h + 2 * ffn) * e + a * t * 4 + 2 * t * 4, r
            assert kept == memory.estimate(h, a, s, b, torch.float32, num_kv_heads=kv, ffn_dim=ffn, norm="rmsnorm",
                                           activation="swiglu"), r
        elif r["row"] == "llama-sdpa":
            # per RMSNorm: its input, the normalised row and the output (3h); the qkv output (h + 2 kv D),
            # rotated q (h) and k (kv D), SDPA's output (h), x1 counted as the second norm's input; gate, up,
            # silu(gate), the product (4 ffn); + SDPA's logsumexp, two rstd and the cos/sin tables [S, D]
            per_token = 3 * h + (h + 2 * kv * D) + h + kv * D + h + 3 * h + 4 * ffn
            assert kept == t * per_token * e + a * t * 4 + 2 * t * 4 + 2 * s * D * e, r
        elif r["row"] in ("eager-ckpt", "sdpa-ckpt"):
            assert kept == t * h * e  # the checkpointed layer's input only
        elif r["row"] == "sdpa":
            # x, LN1 out, qkv (3h: q, k, v are views), SDPA out (h; proj reads a view), x1, LN2 out, fc1 (4h),
            # GELU out (4h), SDPA's logsumexp and the LayerNorms' mean and rstd in fp32
            assert kept == t * h * 16 * e + a * t * 4 + 2 * 2 * t * 4, r
        elif r["row"] == "eager-sac":
            # input + in_proj (3h) + scores [B*a, S, S] + attn@v + out_proj + fc1 (4h) + fc2 outputs
            assert kept == (t * h * (1 + 3 + 1 + 1 + 4 + 1) + b * a * s * s) * e, r
        else:  # eager: see test_memory's hand count of nn.MultiheadAttention's math path
            assert kept == (t * h * 17 + b * a * s * s) * e + 2 * 2 * t * 4, r


def test_quick_run_ratios_and_budget_columns(quick_run):
    _, _, rows = quick_run
    by = {(r["seq"], r["row"]): r for r in rows}
    for r in rows:
        eager, none, sdpa = by[(r["seq"], "eager")], by[(r["seq"], "none")], by[(r["seq"], "sdpa")]
        if r["row"].startswith("llama"):  # the Llama rows compare with the Llama layer on SDPA
            eager = sdpa = by[(r["seq"], "llama-sdpa")]
            assert r["time_vs_none"] == ""
        else:
            assert float(r["time_vs_none"]) == pytest.approx(float(r["step_s"]) / float(none["step_s"]))
        step = float(r["step_s"])
        assert step > 0 and float(r["step_s_min"]) <= step
        assert float(r["time_vs_eager"]) == pytest.approx(step / float(eager["step_s"]))
        assert float(r["time_vs_sdpa"]) == pytest.approx(step / float(sdpa["step_s"]))
        kept, kept_eager = int(r["kept_bytes_per_layer"]), int(eager["kept_bytes_per_layer"])
        assert float(r["kept_vs_eager"]) == pytest.approx(kept / kept_eager)
        assert int(r["peak_bytes"]) > 0
        assert int(r["model_kept_bytes"]) == int(r["model_layers"]) * int(r["kept_bytes_per_layer"])
        assert int(r["budget_bytes"]) == bench.CPU_BUDGET
    for seq in {r["seq"] for r in rows}:
        mb = {k: int(by[(seq, k)]["max_batch"]) for k in bench.CONFIGS["quick"]["rows"]}
        assert mb["full"] > mb["selective"] > mb["none"] >= 1
        assert mb["eager-ckpt"] > mb["eager"] >= 1
        assert mb["llama-selective"] > mb["llama-sdpa"] >= 1


def test_compiled_row_runs_in_its_own_process_with_its_budget(tmp_path):
    """torch.compile rows: one process per activation_memory_budget, SDPA timed beside them there and
    printed, the compiled row's time vs sdpa taken to that printed row; progress covers the compiled row;
    --compile-budget reaches the compiled process and the row's label."""
    out = tmp_path / "compiled"
    cmd = [sys.executable, "-m", "selective_ckpt.bench", "--device", "cpu", "--hidden", "32", "--heads", "2",
           "--layers", "1", "--batch", "1", "--seq", "16", "--repeats", "2", "--warmup", "1", "--no-plots",
           "--rows", "sdpa,sdpa-compile-budget", "--compile-budget", "0.75", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env() | {"PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "results.csv") as f:
        rows = {(r["row"], r["process"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("sdpa", "main"), ("sdpa-compile-budget", "sdpa-compile-budget"),
                         ("sdpa", "sdpa-compile-budget")}
    compiled, beside = rows[("sdpa-compile-budget", "sdpa-compile-budget")], rows[("sdpa", "sdpa-compile-budget")]
    assert float(compiled["activation_memory_budget"]) == 0.75
    assert compiled["ratio_base_sdpa"] == "sdpa@sdpa-compile-budget"
    assert float(compiled["time_vs_sdpa"]) == pytest.approx(float(compiled["step_s"]) / float(beside["step_s"]))
    assert int(compiled["kept_bytes_per_layer"]) > 0
    # a budget below 1 may recompute but never keeps more than the eager SDPA layer
    assert int(compiled["kept_bytes_per_layer"]) <= int(rows[("sdpa", "main")]["kept_bytes_per_layer"])
    label = bench.ROW_LABELS["sdpa"] + " (in the sdpa-compile-budget process)"
    table = proc.stdout.splitlines()
    compiled_label = re.escape("SDPA layer, compile budget 0.75")
    at = next(i for i, line in enumerate(table) if re.match(rf"16 +{compiled_label}  ", line))
    assert label in table[at + 1], table[at: at + 2]  # its SDPA row printed right under it
    assert any(label in line and "time vs sdpa is to that row" in line for line in table)
    # progress: 1 seq x (ledger, peak, 0 more warm-up, 2 timed) = 4 per row; sdpa here, sdpa + compiled there
    assert "(own process)" in proc.stderr and "12/12" in proc.stderr, proc.stderr[-2000:]


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, "-m", "selective_ckpt.bench", "--help"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    actions = [a for a in bench.build_parser()._actions if a.option_strings]
    assert len(actions) > 15
    for action in actions:
        assert action.help, action.option_strings
        for opt in action.option_strings:
            assert opt in proc.stdout, opt


@pytest.mark.parametrize("argv,match", [
    (["--rows", "eager,bogus"], "rows must be"),
    (["--seq", "0,128"], "positive ints"),
    (["--budget", "lots"], "--budget must be"),
    (["--budget", "120%"], "percentage"),
    (["--compile-budget", "1.5"], "in (0, 1]"),
])
def test_bad_flags_are_argparse_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as err:
        bench.build_parser().parse_args(argv)
    assert err.value.code == 2
    assert match in capsys.readouterr().err


def test_bad_configs_are_clear_errors():
    parser = bench.build_parser()
    with pytest.raises(SystemExit, match="divisible"):
        bench.resolve_config(parser.parse_args(["--device", "cpu", "--hidden", "100", "--heads", "3"]))
    with pytest.raises(SystemExit, match="percentage needs --device cuda"):
        bench.resolve_config(parser.parse_args(["--device", "cpu", "--budget", "50%"]))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            bench.resolve_config(parser.parse_args(["--device", "cuda"]))


def test_parse_budget_units():
    assert bench.parse_budget("8GiB") == (8 * 2**30, None)
    assert bench.parse_budget("80GB") == (80 * 10**9, None)
    assert bench.parse_budget("12e9") == (12 * 10**9, None)
    assert bench.parse_budget("1536") == (1536, None)
    assert bench.parse_budget("80%") == (None, 0.8)


def test_default_configs_follow_the_issue():
    cpu, cuda = bench.CONFIGS["cpu"], bench.CONFIGS["cuda"]
    assert (cpu["hidden"], cpu["heads"], tuple(cpu["seqs"])) == (512, 8, (256, 512, 1024)) and 2 <= cpu["layers"] <= 4
    assert (cuda["hidden"], cuda["heads"], tuple(cuda["seqs"]), cuda["dtype"]) == (4096, 32, (2048, 4096, 8192), "bf16")
    assert bench.MODEL_LAYERS == 32


def test_gpu_script_syntax_and_dry_run(tmp_path):
    script = ROOT / "bench" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = _env() | {"PYTHON": sys.executable, "OUT": str(tmp_path)}

    def dry(*args, checks=False):
        proc = subprocess.run(["bash", str(script), "--dry-run", *args], cwd=ROOT, capture_output=True, text=True,
                              env=env | {"DRY_CHECKS": "1" if checks else "0"}, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    out = dry(checks=True)  # the entry points and the CUDA tests' collection checked once
    for step in ("install", "small-model", "lora-step", "attention-dispatch", "layers"):  # the open issues' steps
        assert f"[dry-run] {step}" in out
    assert "bench.offload bench/configs/qwen2.5-0.5b.json --device cuda --seq-len 2048" in out
    assert "sweep parser ok" in out and "dry-selfcheck   ok" in out
    out = dry("--long-context")
    for step in ("install", "offload", "long-context", "plan"):
        assert f"[dry-run] {step}" in out
    assert "selective_ckpt.bench.offload Llama-3.1-8B --device cuda" in out and "[dry-run] small-model" not in out
    out = dry("--earlier")
    for step in ("install", "cuda-tests", "attention", "main-job"):
        assert f"[dry-run] {step}" in out
    assert "[dry-run] offload" not in out
    assert "-m pytest -m cuda" in out and "selective_ckpt.bench --device cuda" in out
    bad = subprocess.run(["bash", str(script), "--bogus"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument" in bad.stderr


def test_each_run_gets_its_own_folder_under_the_current_directory(tmp_path, monkeypatch):
    from selective_ckpt.bench.output import RUNS_DIR, run_dir

    monkeypatch.chdir(tmp_path)
    first, second = run_dir(None, "quick"), run_dir(None, "quick")
    assert first != second and first.parent == second.parent == tmp_path / RUNS_DIR
    assert first.is_dir() and second.is_dir() and first.name.endswith("-quick")
    assert run_dir(tmp_path / "given", "quick") == tmp_path / "given" and (tmp_path / "given").is_dir()


def test_load_watch_warns_only_when_other_work_shared_the_cpus():
    from selective_ckpt.bench.output import LoadWatch

    watch = LoadWatch()
    assert watch.warning() is None and watch.peak is None  # nothing sampled
    watch.samples = [watch.cpus * 0.5, watch.cpus + 0.4]
    assert watch.warning() is None
    watch.samples.append(watch.cpus + 3)
    text = watch.warning()
    assert text.startswith("warning: the machine was busy") and f"{watch.cpus + 3:.1f}" in text
    watch.sample()
    assert len(watch.samples) == 4 and watch.samples[-1] >= 0


@pytest.mark.parametrize("module", ["attention", "attention_gpu", "gelu_mlp", "profile_step", "hf", "offload",
                                    "python_tax"])
def test_benchmarks_run_as_package_modules_from_anywhere(module, tmp_path):
    """The standalone benchmarks are modules of the package: no sys.path edits, no checkout needed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", f"selective_ckpt.bench.{module}", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout[:200]
    source = Path(bench.__file__).with_name(f"{module}.py").read_text()
    assert "sys.path" not in source
    assert not list((ROOT / "bench").glob("*.py")), "benchmark code lives in selective_ckpt/bench/"


def test_progress_falls_back_to_plain_lines(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    prog = bench.Progress(2, enabled=True)
    prog.update("s=64 eager: ledger")
    prog.update("s=64 eager: peak")
    prog.close()
    assert capsys.readouterr().err.splitlines() == ["[1/2] s=64 eager: ledger", "[2/2] s=64 eager: peak"]
    quiet = bench.Progress(1, enabled=False)
    quiet.update("x")
    assert capsys.readouterr().err == ""


def test_attention_table_prints_every_grid_row():
    """bench.attention --table: one row per (mask, D, dtype, S), with the fwd+bwd and forward ratios."""
    cmd = [sys.executable, "-m", "selective_ckpt.bench.attention", "--table", "--seqs", "24,40", "--dims", "16",
           "--dtypes", "fp32,bf16", "--full", "--rounds", "1", "--no-packed"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"kernel ISA (avx512bf16|avx512|avx2|generic)", proc.stdout), proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r" +\d+ +16 ", line)]
    assert sorted((r[0], r[2], r[3]) for r in rows) == sorted(
        (s, m, d) for s in ("24", "40") for m in ("causal", "none") for d in ("fp32", "bf16")), proc.stdout
    assert all(float(r[-3]) > 0 and float(r[-6]) > 0 for r in rows), proc.stdout  # both ratios printed


def test_offload_bench_runs_each_policy_on_cpu(tmp_path, capsys):
    """python -m selective_ckpt.bench.offload (bench/gpu.sh's offload and long-context steps) at a tiny size."""
    import json

    from selective_ckpt.bench import offload

    out = tmp_path / "offload.json"
    assert offload.main(["Llama-3.1-8B", "--layers", "2", "--hidden", "128", "--seq-len", "32", "--form", "lora",
                         "--rank", "4", "--autocast", "bfloat16", "--timed", "0", "--json", str(out), "--policies",
                         "selective;selective, offload mlp;attention-kept, offload input;transformers"]) == 0
    text = capsys.readouterr().out
    assert "| 32 | selective, offload mlp |" in text and "| 32 | attention-kept, offload input |" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["selective", "selective, offload mlp", "attention-kept, offload input",
                                           "transformers"]
    assert len({r["loss"] for r in rows[:3]}) == 1  # the same step whatever is kept where
    assert rows[0]["d2h"] == 0 and rows[1]["d2h"] > 0 and rows[2]["d2h"] > 0 and rows[1]["host_peak"] > 0
    # transformers' own model as it trains by default: the same loss within bf16 autocast, more kept than ours
    assert abs(rows[3]["loss"] - rows[0]["loss"]) <= 1e-2 * abs(rows[0]["loss"])
    assert rows[3]["peak"] > rows[0]["peak"] and rows[3]["d2h"] == 0
    with pytest.raises(SystemExit, match="--policies"):
        offload.main(["Llama-3.1-8B", "--policies", "sometimes"])


def test_python_tax_bench_prints_a_ratio_per_form(capsys):
    from selective_ckpt.bench import python_tax

    assert python_tax.main(["--forms", "fp32", "--rounds", "5"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| fp32 |")]
    assert len(row) == 1 and float(row[0].split("|")[4].split()[0]) > 0
    with pytest.raises(SystemExit, match="--forms"):
        python_tax.main(["--forms", "int3"])
