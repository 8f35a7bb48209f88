"""Test set-up: Triton runs interpreted on CPU tensors when no GPU is present, and the tiers of the suite.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
"""

import atexit
import contextlib
import fnmatch
import importlib.util
import inspect
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# fit's simulated steps (selective_ckpt/fit/step_cache.py) go to one fresh directory per test session, which the xdist
# workers and the command lines they start inherit: a test reads only steps this session's code simulated, and fit
# tests of one model and form that run one after another simulate them once. Set by the controlling process (workers
# have PYTEST_XDIST_WORKER before they read this file).
if "PYTEST_XDIST_WORKER" not in os.environ:
    _FIT_STEPS = tempfile.mkdtemp(prefix="selective_ckpt-fit-steps-")
    os.environ["SELECTIVE_CKPT_FIT_CACHE"] = _FIT_STEPS
    atexit.register(shutil.rmtree, _FIT_STEPS, True)

HAS_CUDA = torch.cuda.is_available()
BACKEND_ENV = "SELECTIVE_CKPT_BACKEND"
# SELECTIVE_CKPT_TEST_ISA=avx512 (or avx2, generic, ...) runs the whole suite on that C++ attention variant, as on
# a CPU that has no better one (bf16 rounding differs between the dot-product and the float paths)
ISA_ENV = "SELECTIVE_CKPT_TEST_ISA"

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

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

# slow: the three tiers above, and every other test over ~2 s on an idle 2-core machine (about 3 s under the usual
# load; `--durations=0` measures them). Globs over "<file relative to tests/>::<test name>"; a name without its
# [parameters] takes in every instance.
SLOW = (
    # fit: simulated steps of bundled configs, the command line, the longest context searches
    "fit/test_fit.py::test_bad_input_names_the_field",
    "fit/test_fit.py::test_bundled_configs_load_and_project",
    "fit/test_fit.py::test_command_line_prints_every_part",
    "fit/test_fit.py::test_every_bundled_config_simulates",
    "fit/test_fit.py::test_fit_check_measures_a_real_step_and_prints_the_prediction_beside_it",
    "fit/test_fit.py::test_longest_context_fits_and_a_longer_one_does_not",
    "fit/test_fit_cli.py::test_no_third_party_noise_on_stderr",
    "fit/test_fit_cli.py::test_the_answer_ends_with_the_calls_that_apply_it",  # the CLI run, ~4 min on 2 loaded cores
    "fit/test_fit_planner.py::test_first_fit_says_whether_the_search_finds_a_plan",
    "fit/test_fit_planner.py::test_keeps_when_everything_fits_offloads_on_a_fast_link_rebuilds_on_a_slow_one",
    "fit/test_fit_planner.py::test_layer_tiled_plans_run_within_5_percent",
    "fit/test_fit_planner.py::test_plan_of_a_model_reads_its_form_and_applies",
    "fit/test_fit_cli.py::test_a_plan_that_does_not_fit_is_not_called_unmodelled",
    "fit/test_fit_longest.py::*",
    "fit/test_fit_policies.py::*",
    "fit/test_fit_planner.py::test_every_plan_runs_within_5_percent_of_its_prediction*",
    "fit/test_fit_planner.py::test_convert_applies_a_plan",
    "models/test_hf_composite.py::test_fit_and_plan_refuse_the_composite_config_and_take_its_text_config",
    "fit/test_growth.py::test_long_contexts_grow_only_by_the_policy",
    "fit/test_bench_plot_marks.py::test_time_plots_carry_the_note",
    # keeping: whole converted models tiled or offloaded, against untiled ones
    "keeping/test_layer_offload.py::test_forwards_without_backward_leave_nothing",
    "keeping/test_offload_engine.py::test_forward_without_backward_leaves_nothing",
    "keeping/test_tiling.py::test_converted_tiled_matches_untiled",
    "keeping/test_tiling.py::test_gpt2_mlp_dropout_stays_the_untiled_mask",
    "keeping/test_tiling.py::test_lora_dropout_in_tiles_is_exact_and_a_redraw_is_caught",
    "keeping/test_tiling.py::test_qlora_tiled",
    "keeping/test_tiling.py::test_selective_layer_tiled_matches_untiled",
    "keeping/test_tiling.py::test_tiles_lower_the_peak_by_their_share_of_the_intermediate",
    # models
    "models/test_example_finetune.py::*",
    # hybrids (tests/models/families/hybrid.py): Qwen3.5 and Qwen3.5-MoE share Qwen3-Next's layer code
    # (models/hybrid.py), whose family checks run in the fast tier; theirs, and each layer kind's printed bytes, here
    "models/test_hf_families.py::*[[]qwen3_5*",
    # Gemma 4's text decoder: its dense family's packed documents in the fast tier, the rest here
    "models/test_hf_families.py::test_layer_keeps_its_estimate[[]gemma4*",
    # Llama 4's and DeepSeek-V3's kept bytes (4-6 s each); their other family checks stay in the fast tier
    "models/test_hf_families.py::test_layer_keeps_its_estimate[[]llama4_text]",
    "models/test_hf_families.py::test_layer_keeps_its_estimate[[]llama4_text_dense]",
    "models/test_hf_families.py::test_layer_keeps_its_estimate[[]deepseek_v3]",
    "models/test_hf_families.py::test_layer_keeps_its_estimate[[]glm4_moe]",
    "models/test_hf_families.py::test_layer_keeps_its_estimate[[]qwen3_next]",
    "models/test_hf_moe.py::test_every_experts_implementation_converts[[]eager-qwen2_moe]",
    "models/test_hf_moe.py::test_every_experts_implementation_converts[[]batched_mm-glm4_moe]",
    "models/test_hf_moe.py::test_every_experts_implementation_converts[[]batched_mm-qwen3_moe]",
    "models/test_training_configs.py::test_dropout_configs_bit_identical_across_modes[[]qlora-dropout]",
    "fit/test_fit_planner.py::test_a_plan_that_cannot_fit_names_the_least_budget",
    "models/test_hf_families.py::test_modes_bit_identical_with_dropout[[]gemma4*",
    "models/test_hf_gemma4.py::test_grouped_mm_experts_within_the_rule",
    "models/test_hf_gemma4.py::test_an_image_in_the_input_within_the_rule",
    "models/test_hf_families.py::test_rule_state_save_load_generate[[]gemma4*",
    "models/test_hf_families.py::test_bfloat16_within_the_rule[[]gemma4*",
    "models/test_hf_families.py::test_no_matmul_is_repeated[[]gemma4*",
    "models/test_hf_families.py::test_lora_both_orders[[]gemma4*",
    "models/test_hf_families.py::test_packed_documents_stay_apart[[]gemma4]",
    "models/test_hf_families.py::test_variant_within_the_rule[[]gemma4*",
    "models/test_hf_hybrid.py::test_kept_bytes_per_layer_kind",
    # Falcon-H1: its float64 rule (padded and not, state dict, save/load, generate) in the fast tier, the rest here
    "models/test_hf_families.py::test_layer_keeps_its_estimate[[]falcon_h1*",
    "models/test_hf_families.py::test_modes_bit_identical_with_dropout[[]falcon_h1*",
    "models/test_hf_families.py::test_bfloat16_within_the_rule[[]falcon_h1*",
    "models/test_hf_families.py::test_no_matmul_is_repeated[[]falcon_h1*",
    "models/test_hf_families.py::test_lora_both_orders[[]falcon_h1*",
    "models/test_hf_falcon_h1.py::*",
    "models/test_hf_hybrid.py::test_packed_documents_as_transformers_packs_them",
    "models/test_hf_activations.py::test_forward_hook_on_the_activation_is_called",
    "models/test_hf_gemma.py::test_final_logit_soft_capping_through_the_loss_head",
    "models/test_hf_llama.py::test_layer_keeps_the_floor",
    "models/test_loss_head_softcap.py::test_capped_loss_bfloat16_within_the_rule",
    "models/test_masked_rows.py::test_unpadded_batches_keep_the_floor_and_padded_ones_one_more_output",
    "models/test_parity_checkpointing.py::test_checkpointed_layers_keep_what_checkpointing_keeps",
    "models/test_parity_pickle.py::test_fresh_process_loads_and_runs_converted_models",
    "models/test_parity_pickle.py::test_loaded_model_keeps_the_floor",
    "models/test_quantized_bases.py::test_int8_kept_bytes_on_other_families",
    "models/test_training_configs.py::test_ledger_sees_what_the_model_keeps",
    "models/test_training_configs.py::test_loss_and_gradients_follow_transformers",
    # ops: the Triton interpreter on the sm_90 tile shapes and the soft-capped kernels
    "ops/test_attention.py::test_identical_calls_are_bit_identical_and_seed_none_follows_manual_seed",
    "ops/test_attention_softcap.py::test_triton_softcap_against_float64",
    "ops/test_attention_softcap.py::test_triton_softcap_with_the_sm90_tiles",
    "ops/test_attention_triton.py::test_sm90_tile_table_against_float64",
    "ops/test_attention_offset.py::test_triton_tiles_concatenate_to_the_untiled_call",
    "ops/test_attention_offset.py::test_opcheck_with_an_offset",
    "ops/test_attention_sinks.py::test_triton_sinks_against_float64",
    "ops/test_attention_sinks.py::test_opcheck_with_sinks",
    "ops/test_attention_sinks.py::test_triton_sinks_with_the_sm90_tiles",
    "ops/test_attention_value_dim.py::test_triton_value_head_dim",
    # the benchmarks run as subprocesses, two-process training, whole layers on both backends
    "test_bench.py::test_attention_table_prints_every_grid_row",
    "test_bench.py::test_gpu_script_syntax_and_dry_run",
    "test_bench.py::test_offload_bench_runs_each_policy_on_cpu",
    "test_bench.py::test_quick_run_prints_the_table_and_writes_csv",
    "test_bench_hf.py::*",
    "test_distributed.py::*",
    "test_edges.py::test_dropout_double_backward_is_right",
    "test_layer_llama.py::test_gqa_layer_both_backends_and_modes",
    "test_layer_llama.py::test_recompute_modes_are_bit_identical",
)

# sweeps over the whole family table (tests/models/families): the fast run keeps the instances whose `family`
# parameter is named here, the others are slow. The fit's peak sweeps a second axis (forms, variants); LoRA in both
# orders (adapters added before and after convert) runs the same code in every family, so a dense, a
# parallel-residual, a mixture-of-experts and a hybrid family stand for the rest. (The other shared family checks of
# models/test_hf_families.py run for every family in the fast run.)
SWEEPS = {
    "fit/test_fit.py::test_predicted_peak_within_5_percent": ("llama",),
    "models/test_hf_families.py::test_lora_both_orders": ("llama", "gpt_neox", "mixtral", "qwen3_next"),
}

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
    if module is None:
        return text in source
    key = (module.__name__, text)
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
    names = (f"{relpath}::{name}", f"{relpath}::{item.name}")
    if tiers or any(fnmatch.fnmatch(n, pattern) for n in names for pattern in SLOW) or _swept(item, names[0]):
        tiers.append("slow")
    return tiers


def _swept(item, name):
    """An instance of a sweep over the family table for a family its SWEEPS entry does not keep fast."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return name in SWEEPS and "family" in params and str(params["family"]) not in SWEEPS[name]


# ---- warnings --------------------------------------------------------------------------------------------------
# The suite runs without warnings. pyproject.toml's filterwarnings drops the third-party ones we cannot act on, each
# with its reason; a test that makes selective_ckpt warn on purpose asserts it with pytest.warns; and a warning that
# selective_ckpt's own code gives anywhere else fails the test (or the collection) it came from. "Own code": the
# Python frame that issued the warning (its warnings.warn, or the torch or numpy call that warned from C) lies in
# the package's source, whatever module `stacklevel` attributes the warning to — a filter on the module would miss
# every warning addressed to the caller.
OWN_SOURCES = (ROOT / "selective_ckpt", ROOT / "triton_kernels", ROOT / "examples", ROOT / "bench")


def _installed_sources():
    spec = importlib.util.find_spec("selective_ckpt")
    return [Path(p) for p in (spec.submodule_search_locations or ())] if spec else []


class OwnWarnings:
    """Fails a test whose setup, call or teardown got a warning issued in `roots` outside pytest.warns (and a
    collection that got one, such as a warning at import). Other warnings reach pytest's record unchanged."""

    def __init__(self, roots):
        self.roots = tuple(os.path.join(os.path.realpath(r), "") for r in roots)

    def issued_here(self, filename):
        return os.path.realpath(filename).startswith(self.roots)

    @contextlib.contextmanager
    def watching(self):
        """Within, warnings.showwarning notes the warnings issued in `roots` and hands every warning on to
        the record of the innermost catch_warnings(record=True) (pytest's own, per test): a warning reaches
        showwarning only after the filters let it through, and pytest.warns, which records with a
        catch_warnings of its own, takes the warnings it expects before they get here."""
        caught = []

        def showwarning(message, category, filename, lineno, file=None, line=None):
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__") in ("warnings", "_py_warnings"):
                frame = frame.f_back  # the warnings module's own frames (its warn is C, and has none)
            if frame is not None and self.issued_here(frame.f_code.co_filename):
                caught.append(f"{frame.f_code.co_filename}:{frame.f_lineno}: {category.__name__}: {message}")
            sys.modules["warnings"]._showwarnmsg_impl(warnings.WarningMessage(message, category, filename, lineno,
                                                                              file, line))

        previous = warnings.showwarning
        warnings.showwarning = showwarning
        try:
            yield caught
        finally:
            warnings.showwarning = previous

    @staticmethod
    def explain(caught):
        return ("selective_ckpt warned (assert a warning the test expects with pytest.warns; fix the cause of "
                "any other):\n" + "\n".join(f"  {c}" for c in caught))

    def _guarded(self):
        with self.watching() as caught:
            result = yield
        if caught:
            pytest.fail(self.explain(caught), pytrace=False)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        return (yield from self._guarded())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self._guarded())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        return (yield from self._guarded())

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        with self.watching() as caught:
            report = yield
        if caught and report.outcome != "failed":
            report.outcome, report.longrepr = "failed", self.explain(caught)
        return report


OWN_WARNINGS_PLUGIN = "selective_ckpt-own-warnings"


@pytest.fixture(autouse=True, scope="session")
def _said_once_per_process():
    """selective_ckpt gives one notice once per process: in training with labels, the fused loss head returns
    logits=None. Which test meets it first depends on which tests run, so the suite takes it as given;
    tests/models/test_loss_head_logits.py gives it again on a fresh record and asserts it with pytest.warns."""
    from selective_ckpt.models import loss_head

    loss_head._SAID.add("logits")
    yield


def pytest_configure(config):
    config.pluginmanager.register(OwnWarnings([*OWN_SOURCES, *_installed_sources()]), OWN_WARNINGS_PLUGIN)
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


# a test outside the slow tier whose call took longer than SLOW_SECONDS is named at the end of the run: a test
# for SLOW above
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
