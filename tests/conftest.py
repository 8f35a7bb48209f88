"""Test set-up: Triton runs interpreted on CPU tensors when no GPU is present, and the tiers of the suite.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
"""

import fnmatch
import inspect
import os
import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
BACKEND_ENV = "SELECTIVE_CKPT_BACKEND"
# SELECTIVE_CKPT_TEST_ISA=avx512 (or avx2, generic, ...) runs the whole suite on that C++ attention variant, as on
# a CPU that has no better one (bf16 rounding differs between the dot-product and the float paths)
ISA_ENV = "SELECTIVE_CKPT_TEST_ISA"

TESTS = Path(__file__).resolve().parent

# ---- tiers ---------------------------------------------------------------------------------------------------
# `python -m pytest` runs everything (CI: README's command). `python -m pytest -m "not slow"` is the fast run.
# Markers are given here, by test file and test name, so a new test lands in its tier without a decorator.
# Files are globs relative to tests/; names are regular expressions searched in the test function's name
# (without its parameters); `source` is text searched in the test function's own source.
TIERS = {
    # build: builds the package — the sdist and the wheel installed in a fresh venv (the `wheel` tests), the
    # extension built in place, the package imported in a subprocess without Triton
    "build": dict(files=("test_build.py", "test_wheel.py")),
    # compile: ptxas compiles every Triton launch for sm_90 without a GPU (tests/gpu_compile_check.py), and
    # every test that runs torch.compile (dynamo and inductor: seconds per graph on a CPU)
    "compile": dict(files=("test_gpu_compile.py",), names=r"torch_compile|compile_dynamic|fullgraph|compiled_row",
                    source="torch.compile("),
    # convergence: training runs of many optimizer steps, each step's loss held to the unconverted model's
    "convergence": dict(names=r"converg|unconverted_loss|loss_curve|trains"),
}

# slow: the three tiers above, and every other test measured over ~3 s on 2 cores. Globs over
# "<file relative to tests/>::<test name with its parameters>".
SLOW = (
    # from a --durations run of the whole suite on 2 cores: the files and tests that held most of its time
    "fit/test_fit.py::test_predicted_peak_within_5_percent*", "fit/test_fit_longest.py::*",
    "fit/test_fit_policies.py::*", "models/test_hf_families.py::*", "models/test_quantized_bases.py::*",
    "models/test_training_configs.py::*", "models/test_hf_moe.py::*", "models/test_moe_sync.py::*",
    "models/test_parity_*.py::*", "models/test_example_finetune.py::*", "models/test_loss_head.py::*",
    "models/test_hf_plan_compile.py::*", "models/test_hf_parallel_families.py::*", "models/test_hf_gemma.py::*",
    "keeping/test_layer_offload.py::test_converted*", "ops/test_attention_triton.py::*",
    "ops/test_attention_kernel_cpp.py::*", "ops/test_attention_softcap.py::*", "ops/test_attention.py::*",
    "ops/test_cross_entropy.py::*", "test_bench.py::*", "test_bench_hf.py::*", "test_edges.py::*",
)

SLOW_SECONDS = 3.0


def _matches(rule, relpath, name, function):
    if any(fnmatch.fnmatch(relpath, f) for f in rule.get("files", ())):
        return True
    if rule.get("names") and re.search(rule["names"], name):
        return True
    return bool(rule.get("source")) and function is not None and _runs(function, rule["source"])


def _source(obj):
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


_helpers = {}


def _runs(function, text):
    """`text` is in the test function's source, or in a function of its module that the test calls."""
    source = _source(function)
    module = inspect.getmodule(function)
    key = (getattr(module, "__name__", None), text)
    if key not in _helpers:
        _helpers[key] = [name for name, f in vars(module).items() if inspect.isfunction(f) and
                         f.__module__ == module.__name__ and not name.startswith("test") and text in _source(f)]
    return text in source or any(re.search(rf"\b{name}\(", source) for name in _helpers[key])


def _tier_markers(item):
    relpath = Path(item.path).resolve().relative_to(TESTS).as_posix()
    name = getattr(item, "originalname", item.name)
    function = getattr(item, "function", None)
    tiers = [tier for tier, rule in TIERS.items() if _matches(rule, relpath, name, function)]
    if "wheel" in item.keywords and "build" not in tiers:
        tiers.append("build")
    if tiers or any(fnmatch.fnmatch(f"{relpath}::{item.name}", pattern) for pattern in SLOW):
        tiers.append("slow")
    return tiers


def pytest_configure(config):
    isa = os.environ.get(ISA_ENV)
    if isa:
        from selective_ckpt import _C

        _C.attention_use_isa(isa)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        for tier in _tier_markers(item):
            item.add_marker(tier)


# a test outside the slow tier that took longer than SLOW_SECONDS is named at the end of the run: the place to
# list it is SLOW above
_over = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed and report.duration > SLOW_SECONDS and "slow" not in report.keywords:
        _over.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _over:
        terminalreporter.section("outside the slow tier, over 3 s (tests/conftest.py: SLOW)")
        for duration, nodeid in sorted(_over, reverse=True)[:10]:
            terminalreporter.write_line(f"{duration:6.1f} s  {nodeid}")
        if len(_over) > 10:
            terminalreporter.write_line(f"... and {len(_over) - 10} more")


@pytest.fixture
def use_backend(monkeypatch):
    """use_backend('cpp' | 'triton') routes CPU tensors to that backend for the test."""

    def choose(name):
        monkeypatch.setenv(BACKEND_ENV, "triton" if name == "triton" else "auto")

    return choose


@pytest.fixture(params=["cpp", "triton"])
def backend(request, use_backend):
    """Runs a test once per backend on CPU tensors (Triton through the interpreter)."""
    use_backend(request.param)
    return request.param
