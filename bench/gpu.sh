#!/usr/bin/env bash
# One-shot GPU check for a lent machine (one H200; budget: 10 minutes a command).
#
#   bash bench/gpu.sh            # install check, then the open issues' steps (GPU speed): a small model's step
#                                # (Qwen2.5-0.5B's published shape, 2K tokens, full fine-tune under bf16 autocast)
#                                # and Llama-3.1-8B's LoRA step at 8K, converted against transformers' own; the
#                                # attention op under each kernel it dispatches to (rows name the kernel); the
#                                # Llama layer against the Llama SDPA layer at 2K-4K
#   bash bench/gpu.sh --long-context  # Llama-3.1-8B's step under each layer policy (keep / offload / rebuild) at
#                                # 16K-32K with the host link's rate, attention-kept against full recompute at 64K,
#                                # and the planner's plan for an 80 GB card against transformers' checkpointing at
#                                # 16K-64K, predicted vs measured
#   bash bench/gpu.sh --earlier  # the earlier steps: CUDA tests (parallel), Llama-3.1-8B's whole step
#                                # against the fit model, the main job at the 7B shape, per-kernel attention
#                                # sweep vs SDPA (FLASH and cuDNN pinned), 7B layer with dropout
#   bash bench/gpu.sh --dry-run  # CPU: print every command, check that the entry points parse; runs nothing heavy
#                                # (DRY_CHECKS=0: print the commands only)
#
# Writes under $OUT when set (else bench/out/): summary.txt, steps.log (install + tests),
# attention_gpu.log, attention_dispatch.log, attention/{attention_gpu.csv, attention_dispatch.csv, layer_7b.csv},
# fit_check.{log,json}, main.log and
# main/{results.csv, PNGs}, small_model.{log,json}, lora_step.{log,json}, layers.log, offload.{log,json},
# long_context.{log,json}, plan.{log,json}. A selective_ckpt/_C built for the
# machine's Python beforehand is used as it is.
# The short table is printed last.
# Environment: PYTHON (default python3), STEP_TIMEOUT_SCALE (multiplies each step's time limit).
# Every step runs even when an earlier one fails; the exit status is 1 if any step failed.

set -uo pipefail

DRY=0
GROUP=speed
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --earlier) GROUP=earlier ;;
    --long-context) GROUP=long-context ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg' (use --dry-run, --long-context, --earlier or --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
DEST=${OUT:-bench/out}
SCALE=${STEP_TIMEOUT_SCALE:-1}
mkdir -p "$DEST/main" || exit 2
SUMMARY="$DEST/summary.txt"
: > "$SUMMARY"
FAILED=0
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME SECONDS LOG CMD...: run CMD with a time limit, output appended to LOG; record the outcome.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  limit=$(awk -v a="$limit" -v b="$SCALE" 'BEGIN { printf "%d", a * b }')
  if [ "$DRY" = 1 ]; then
    printf '[dry-run] %-15s (limit %4ss) %s >> %s\n' "$name" "$limit" "$*" "$log"
    return 0
  fi
  echo "== $name: $*" | tee -a "$log"
  local t0=$SECONDS rc
  # bash -c so that the exported shell functions below run under timeout like programs do
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >> "$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  if [ "$rc" = 0 ]; then
    note "$(printf '%-15s ok     %4ss' "$name" "$took")"
  else
    [ "$rc" = 124 ] && why="timed out after ${limit}s" || why="exit $rc"
    note "$(printf '%-15s FAILED %4ss (%s, see %s)' "$name" "$took" "$why" "$log")"
    tail -n 20 "$log"
    FAILED=1
  fi
  return "$rc"
}

environment() {
  nvidia-smi -L
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
    "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'
}

install_package() {
  # Installing needs setuptools >= 77 (pyproject's license field) and the machine is offline, so
  # there is no build isolation to fetch one. Without it: build _C in place (`setup.py inplace`
  # skips setuptools' pyproject reading) and reach the Triton kernels through a link, as the
  # installed package maps them; PYTHONPATH points here.
  local v
  # a _C built elsewhere for this Python (carried in) that loads and matches the sources needs no build
  if "$PY" -c 'import selective_ckpt' 2>/dev/null; then
    echo "selective_ckpt._C present and current: no build"
    [ -e selective_ckpt/triton_kernels ] || ln -sfn ../triton_kernels selective_ckpt/triton_kernels
    return 0
  fi
  v=$("$PY" -c 'import setuptools; print(setuptools.__version__)') || return 1
  echo "setuptools $v"
  if [ "${v%%.*}" -ge 77 ] && "$PY" -m pip install --no-build-isolation --no-deps -q -e .; then
    return 0
  fi
  echo "no editable install: building _C in place"
  "$PY" setup.py inplace && ln -sfn ../triton_kernels selective_ckpt/triton_kernels
}

attention_sweep() {
  "$PY" -m selective_ckpt.bench.attention_gpu --out "$DEST/attention" --no-dispatch
}

# selective_ckpt.attention as callers run it, forced onto each kernel it can dispatch to (ours, FlashAttention, the
# memory-efficient kernel, auto) per kind of call; every row names the kernel that ran.
attention_dispatch_sweep() {
  "$PY" -m selective_ckpt.bench.attention_gpu --out "$DEST/attention" --dispatch-only --quick
}

# The sweep's closing table: from its header line to the end of the log.
last_table() { sed -n '/^== attention bf16/,$p'; }

short_table() {
  echo
  echo "== attention sweep (bf16): the table selective_ckpt.bench.attention_gpu printed last"
  if grep -q '^== attention bf16' "$DEST/attention_gpu.log" 2>/dev/null; then
    sed -n '/^== attention bf16/,$p' "$DEST/attention_gpu.log"
  else
    echo "(no sweep figures)"
  fi
  echo
  if grep -q '^== attention dispatch' "$DEST/attention_dispatch.log" 2>/dev/null; then
    sed -n '/^== attention dispatch/,$p' "$DEST/attention_dispatch.log"
  else
    echo "== attention dispatch: (no table; rows so far)"
    grep -E '^dispatch ' "$DEST/attention_dispatch.log" 2>/dev/null || echo "(no dispatch figures)"
  fi
  echo
  echo "== Llama-3.1-8B step against the fit model (LoRA r=16, bf16 autocast, 8192 tokens)"
  grep -E '^\|' "$DEST/fit_check.log" 2>/dev/null || echo "(no fit-check figures)"
  echo
  echo "== main job (7B layer, bf16): see $DEST/main.log for the full table"
  grep -E '^seq [0-9]+:' "$DEST/main.log" 2>/dev/null || echo "(no main-job figures)"
}

export PY DEST
export -f environment install_package attention_sweep attention_dispatch_sweep

if [ "$DRY" = 1 ]; then
  echo "[dry-run] python: $PY; output folder: $DEST"
fi
if [ "$DRY" = 1 ] && [ "${DRY_CHECKS:-1}" = 1 ]; then
  for f in setup.py selective_ckpt/bench/attention_gpu.py; do
    [ -f "$f" ] || { echo "[dry-run] missing $f" >&2; FAILED=1; }
  done
  "$PY" -m selective_ckpt.bench --help > /dev/null || { echo "[dry-run] selective_ckpt.bench --help failed" >&2; FAILED=1; }
  "$PY" -m selective_ckpt.bench.fit_check --help > /dev/null || { echo "[dry-run] selective_ckpt.bench.fit_check --help failed" >&2; FAILED=1; }
  "$PY" -m selective_ckpt.bench.offload --help > /dev/null || { echo "[dry-run] selective_ckpt.bench.offload --help failed" >&2; FAILED=1; }
  "$PY" -m selective_ckpt.bench.attention_gpu --dry-run --out "$DEST/attention" \
    || { echo "[dry-run] selective_ckpt.bench.attention_gpu failed" >&2; FAILED=1; }
  "$PY" -m selective_ckpt.bench.attention_gpu --dry-run --out "$DEST/attention" --dispatch-only --quick \
    || { echo "[dry-run] selective_ckpt.bench.attention_gpu --dispatch-only failed" >&2; FAILED=1; }
  "$PY" -m pytest -m cuda -q -p no:cacheprovider --collect-only tests/ > /dev/null \
    || { echo "[dry-run] collecting the CUDA tests failed" >&2; FAILED=1; }
  got=$(printf '%s\n' 'S= 1024 D= 64 ... fwd 0.1 ms' '== attention bf16, forward TFLOP/s' '1024 64 True 300.0' | last_table)
  if [ "$(printf '%s\n' "$got" | wc -l)" = 2 ]; then echo "[dry-run] sweep parser ok"; else
    echo "[dry-run] sweep parser gave '$got'" >&2; FAILED=1; fi
  # The machinery itself: a function under `step`.
  selfcheck() { "$PY" -c 'import selective_ckpt' && echo "functions run under timeout"; }
  export -f selfcheck
  DRY=0 step dry-selfcheck 60 "$DEST/steps.log" selfcheck || FAILED=1
fi

step environment 20 "$DEST/steps.log" environment
step install 90 "$DEST/steps.log" install_package

OFFLOAD_ARGS=(Llama-3.1-8B --device cuda --form lora --rank 16 --autocast bfloat16 --timed 1)
if [ "$GROUP" = speed ]; then
  # Limits sum to 580 s with environment and install. The GPU step at the speed of the fastest attention: targets
  # small model <= 1.05x transformers', the 8B LoRA step and the Llama layer <= 1.03x.
  step small-model 90 "$DEST/small_model.log" "$PY" -m selective_ckpt.bench.offload bench/configs/qwen2.5-0.5b.json \
    --device cuda --seq-len 2048 --batch 4 --form full --autocast bfloat16 --timed 10 \
    --policies "selective;transformers" --json "$DEST/small_model.json"
  step lora-step 170 "$DEST/lora_step.log" "$PY" -m selective_ckpt.bench.offload Llama-3.1-8B --device cuda \
    --form lora --rank 16 --autocast bfloat16 --seq-len 8192 --timed 3 --policies "selective;transformers" \
    --json "$DEST/lora_step.json"
  step attention-dispatch 90 "$DEST/attention_dispatch.log" attention_dispatch_sweep
  step layers 120 "$DEST/layers.log" "$PY" -m selective_ckpt.bench --device cuda --no-progress --seq 2048,4096 \
    --rows llama-sdpa,llama-selective,sdpa,selective --out "$DEST/main"
  [ "$DRY" = 1 ] && exit "$FAILED"
  echo
  echo "== steps (logs in $DEST)"
  cat "$SUMMARY"
  grep -hE '^\|' "$DEST/small_model.log" "$DEST/lora_step.log" 2>/dev/null
  sed -n '/^== attention dispatch/,$p' "$DEST/attention_dispatch.log" 2>/dev/null
  grep -E '^seq [0-9]+:' "$DEST/layers.log" 2>/dev/null || echo "(no layer figures)"
  exit "$FAILED"
fi
if [ "$GROUP" = long-context ]; then
  # Limits sum to 570 s with environment and install. Each row builds the 8B model and runs 3 steps (build ~8 s, a
  # 32K step ~3-6 s on an H200).
  # Long context, 1 of 3: what each policy holds on the GPU and in host memory, and what offloading costs in time.
  step offload 140 "$DEST/offload.log" "$PY" -m selective_ckpt.bench.offload "${OFFLOAD_ARGS[@]}" \
    --seq-len 16384,32768 --json "$DEST/offload.json" \
    --policies "selective;selective, offload mlp;full, offload input"
  # Long context, 2 of 3: attention kept (never recomputed) against whole-layer recompute, untiled and in layer tiles.
  step long-context 100 "$DEST/long_context.log" "$PY" -m selective_ckpt.bench.offload "${OFFLOAD_ARGS[@]}" \
    --seq-len 65536 --json "$DEST/long_context.json" \
    --policies "attention-kept;full;full, offload input, layer in 16 tiles"
  # Long context, 3 of 3: the planner's plan for an 80 GB card (emulated) and 256 GB of pinned host memory against
  # transformers' checkpointing (and its offload) and whole-layer recompute with offloaded inputs, each row's
  # predicted peak and step time (the shipped H200 rates) beside the measured.
  step plan 220 "$DEST/plan.log" "$PY" -m selective_ckpt.bench.offload "${OFFLOAD_ARGS[@]}" \
    --seq-len 16384,32768,65536 --gpu 80GiB --host 256GB --rates H200 --predict --json "$DEST/plan.json" \
    --policies "plan;transformers + gradient checkpointing;transformers + offloaded checkpointing;full, offload input"
  [ "$DRY" = 1 ] && exit "$FAILED"
  echo
  echo "== steps (logs in $DEST)"
  cat "$SUMMARY"
  grep -hE '^(\||host link|plan at|rates)' "$DEST/offload.log" "$DEST/long_context.log" "$DEST/plan.log" 2>/dev/null
  exit "$FAILED"
fi

# Limits sum to 590 s (an H200, 2026-12-04: tests 126 s, fit check 38, main job 21, sweep 59); the sweeps come
# last, and their logs keep every point printed if one is cut short. The dispatch rows (9 points x 4 settings) are
# not measured yet: their limit is what the kernel sweep's 150 s gave up.
# pytest-xdist when present: the CUDA tests in parallel workers on the one GPU
PAR=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 4")
# shellcheck disable=SC2086
step cuda-tests 150 "$DEST/steps.log" "$PY" -m pytest -m cuda -q -p no:cacheprovider $PAR tests/
# the fit model's Llama-3.1-8B projection (LoRA r=16 all-linear, bf16 autocast, 8192 tokens) measured at full size
step fit-check 100 "$DEST/fit_check.log" "$PY" -m selective_ckpt.bench.fit_check Llama-3.1-8B --device cuda \
  --seq-len 8192 --form lora --rank 16 --autocast bfloat16 --timed 1 --no-predict --json "$DEST/fit_check.json"
# the torch.compile rows (a subprocess and a compile each) do not fit the budget: 90 s ran out before them
step main-job 80 "$DEST/main.log" "$PY" -m selective_ckpt.bench --device cuda --no-progress --seq 2048,4096 \
  --rows sdpa,sdpa-ckpt,none,selective,full,llama-sdpa,llama-selective --out "$DEST/main"
step attention 100 "$DEST/attention_gpu.log" attention_sweep
step attention-dispatch 50 "$DEST/attention_dispatch.log" attention_dispatch_sweep

if [ "$DRY" = 1 ]; then
  echo "[dry-run] then prints the step summary, the sweep table and the main job's summary lines"
  exit "$FAILED"
fi
short_table >> "$SUMMARY"
echo
echo "== steps (logs in $DEST)"
cat "$SUMMARY"
exit "$FAILED"
