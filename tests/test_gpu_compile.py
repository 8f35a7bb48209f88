"""Every Triton kernel, at the configurations the entry points launch and with a real launch's
specialisation, compiles for sm_90 (Hopper) without a GPU (tests/gpu_compile_check.py): no 16-bit
configuration spills, none needs more shared memory than sm_90 has, and the attention matrix
(fp16/bf16/fp32 x head dim 64/128/80 x causal x dropout, GQA, window, documents) is covered."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("gpu_compile_check.py")
SHARED_LIMIT = 227 * 1024


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("sm90") / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SELECTIVE_CKPT_BACKEND")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_kernel_compiles(records):
    names = {r["kernel"] for r in records}
    expected = {"_dropout_kernel", "_fwd_kernel", "_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_gelu_kernel",
                "_gelu_backward_kernel", "_forward_kernel", "_apply_kernel", "_backward_kernel", "_philox_words_kernel",
                "_attention_mask_kernel", "_elementwise_mask_kernel", "_product_kernel"}
    assert expected <= names, f"not compiled: {sorted(expected - names)}"
    cases = {str(r.get("case", "")) for r in records}
    for case in ("rms_norm offset=0.0", "rms_norm offset=1.0", "swiglu_mlp silu", "swiglu_mlp gelu_tanh",
                 "llama layer"):
        assert case in cases, f"nothing compiled for {case}"


def test_no_spills_in_16_bit_and_shared_memory_fits(records):
    spilled = [r for r in records if r["dtype"] in ("fp16", "bf16") and (r["n_spills"] or r["local_bytes"])]
    assert not spilled, [(r["kernel"], r.get("case"), r["constexprs"], r["n_spills"]) for r in spilled]
    big = [r for r in records if r["shared"] > SHARED_LIMIT]
    assert not big, [(r["kernel"], r["constexprs"], r["shared"]) for r in big]


def test_attention_matrix_is_covered_with_launch_alignment(records):
    att = [r for r in records if r["kernel"] in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")]
    seen = {(r["kernel"], r["dtype"], r["head_dim"], r["constexprs"]["CAUSAL"], r["constexprs"]["DROPOUT"])
            for r in att}
    for kernel in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        for dtype in ("fp16", "bf16", "fp32"):
            for d in (64, 128, 80):
                for causal in (False, True):
                    for dropout in (False, True):
                        assert (kernel, dtype, d, causal, dropout) in seen
    for flag in ("WINDOW", "VARLEN", "HAS_PAD"):
        assert any(r["constexprs"][flag] for r in att), flag
    assert any(not r["constexprs"]["EVEN_M"] for r in att)
    # what a real launch specialises: 16-byte aligned tensors and strides reach the compiler
    fwd = next(r for r in att if r["kernel"] == "_fwd_kernel")
    assert {"Q", "K", "V", "OUT", "LSE", "sqh", "skh"} <= set(fwd["divisible"])


def test_dropout_main_loop_cost(records):
    """Philox once per 8 columns, computed in the score tile's own layout: the D=128 bf16 forward's
    main loop with dropout stays within 1.6x of the loop without (1.51x measured; 2.15x when the
    flags were expanded by joins and converted, 3.1x with Philox per element)."""
    fwd = {r["constexprs"]["DROPOUT"]: r["n_instructions"] for r in records
           if r["kernel"] == "_fwd_kernel" and r["dtype"] == "bf16" and r["head_dim"] == 128 and r.get("case") == "base"
           and not r["constexprs"]["CAUSAL"]}
    assert fwd[True] <= 1.6 * fwd[False], fwd
