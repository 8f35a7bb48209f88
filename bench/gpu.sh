#!/usr/bin/env bash
# One-shot GPU check for a lent machine (one H200; budget: under 8 minutes in all).
#
#   bash bench/gpu.sh            # install, CUDA tests, attention TFLOP/s sweep, the main job at the 7B shape
#   bash bench/gpu.sh --dry-run  # CPU: print every command, check that the entry points parse; runs nothing heavy
#
# Writes under $OUT when set (else bench/out/), at most 8 files so all of them come back from a lent
# machine: summary.txt, steps.log (install + tests), attention_sweep.log/.csv, main.log and
# main/{results.csv, kept_memory.png, step_time.png}. The short table is printed last.
# Environment: PYTHON (default python3), STEP_TIMEOUT_SCALE (multiplies each step's time limit).
# Every step runs even when an earlier one fails; the exit status is 1 if any step failed.

set -uo pipefail

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
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
  # Offline machine: no build isolation (it would fetch setuptools/pybind11/ninja); fall back to an
  # in-place build, which PYTHONPATH above makes importable.
  "$PY" -m pip install --no-build-isolation --no-deps -q -e . || "$PY" setup.py -q build_ext --inplace
}

# bench/attention.py's output as CSV lines: each table follows a header "attention B=.. H=.. S=.. D=..
# <dtype> causal=.. dropout=.. on <device>"; its rows are impl, 5 figures and 2 TFLOP/s on CUDA.
parse_sweep() {
  awk '/^attention B=/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] } next }
       $1 ~ /^(selective_ckpt|sdpa)$/ && $2 ~ /^[0-9.]+$/ && NF >= 8 {
         printf "%s,%s,%s,%s,%s,%s", v["S"], v["D"], v["H"], v["B"], v["dropout"], $1
         for (i = 2; i <= NF; i++) printf ",%s", $i
         printf "\n" }'
}

# The attention sweep, in one process (imports and compiled kernels are shared): causal bf16, seq
# 1024..8192, head dim 64 and 128, dropout 0 and 0.1, against SDPA; B*S = 16384 tokens and
# H*D = 2048, so every point does the same projection work per token.
attention_sweep() {
  local log=$1 csv=$2 rc
  echo "seq,dim,heads,batch,dropout,impl,fwd_ms,bwd_ms,fwdbwd_ms,peak_mib,kept_mib,fwd_tflops,bwd_tflops" > "$csv"
  "$PY" - > "$log.part" 2>&1 <<'PYEOF'
import importlib.util
import sys
import traceback

spec = importlib.util.spec_from_file_location("attention_bench", "bench/attention.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
failed = 0
for d in (64, 128):
    for s in (1024, 2048, 4096, 8192):
        for p in (0.0, 0.1):
            argv = ["--device", "cuda", "--dtype", "bf16", "--causal", "--batch", str(16384 // s),
                    "--heads", str(2048 // d), "--seq", str(s), "--dim", str(d), "--dropout", str(p),
                    "--impls", "selective_ckpt,sdpa", "--repeats", "5", "--warmup", "2"]
            try:
                bench.main(argv)
            except Exception:
                failed += 1
                print("FAILED:", " ".join(argv))
                traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
sys.exit(1 if failed else 0)
PYEOF
  rc=$?
  cat "$log.part" >> "$log"
  parse_sweep < "$log.part" >> "$csv"
  rm -f "$log.part"
  return "$rc"
}

short_table() {
  echo
  echo "== attention sweep (causal bf16, fwd TFLOP/s): selective_ckpt vs sdpa"
  if [ -s "$DEST/attention_sweep.csv" ]; then
    awk -F, 'NR > 1 { k = $1 "," $2 "," $5; if ($6 == "sdpa") sd[k] = $12; else { ou[k] = $12; o[++n] = k } }
             END { printf "%6s %4s %7s %10s %10s %7s\n", "seq", "dim", "dropout", "ours", "sdpa", "ratio";
                   for (i = 1; i <= n; i++) { split(o[i], a, ",");
                     r = (sd[o[i]] > 0) ? sprintf("%.2f", ou[o[i]] / sd[o[i]]) : "-";
                     printf "%6s %4s %7s %10s %10s %7s\n", a[1], a[2], a[3], ou[o[i]], sd[o[i]], r } }' \
      "$DEST/attention_sweep.csv"
  else
    echo "(no sweep figures)"
  fi
  echo
  echo "== main job (7B layer, bf16): see $DEST/main.log for the full table"
  grep -E '^seq [0-9]+:' "$DEST/main.log" 2>/dev/null || echo "(no main-job figures)"
}

export PY DEST
export -f environment install_package parse_sweep attention_sweep

if [ "$DRY" = 1 ]; then
  echo "[dry-run] python: $PY; output folder: $DEST"
  for f in setup.py bench/attention.py selective_ckpt/bench/__init__.py; do
    [ -f "$f" ] || { echo "[dry-run] missing $f" >&2; FAILED=1; }
  done
  "$PY" -m selective_ckpt.bench --help > /dev/null || { echo "[dry-run] selective_ckpt.bench --help failed" >&2; FAILED=1; }
  "$PY" bench/attention.py --help > /dev/null || { echo "[dry-run] bench/attention.py --help failed" >&2; FAILED=1; }
  # The machinery itself: a function under `step` and the sweep parser on a canned table.
  selfcheck() { "$PY" -c 'import selective_ckpt' && echo "functions run under timeout"; }
  export -f selfcheck
  DRY=0 step dry-selfcheck 60 "$DEST/steps.log" selfcheck || FAILED=1
  got=$(printf '%s\n' 'attention B=16 H=32 S=1024 D=64 bf16 causal=True dropout=0.1 on cuda (torch threads 8)' \
        'impl fwd ms' 'sdpa 0.80 1.50 2.30 12.00 6.00 150.0 160.0' \
        'selective_ckpt / sdpa: fwd 1.25x bwd 1.1x fwd+bwd 1.2x peak 0.5x kept 0.4x' | parse_sweep)
  if [ "$got" = "1024,64,32,16,0.1,sdpa,0.80,1.50,2.30,12.00,6.00,150.0,160.0" ]; then
    echo "[dry-run] sweep parser ok"
  else
    echo "[dry-run] sweep parser gave '$got'" >&2; FAILED=1
  fi
fi

step environment 30 "$DEST/steps.log" environment
step install 90 "$DEST/steps.log" install_package
step cuda-tests 120 "$DEST/steps.log" "$PY" -m pytest -m cuda -x -q -p no:cacheprovider tests/
step attention 110 "$DEST/attention_sweep.log" attention_sweep "$DEST/attention_sweep.log" "$DEST/attention_sweep.csv"
step main-job 130 "$DEST/main.log" "$PY" -m selective_ckpt.bench --device cuda --no-progress --out "$DEST/main"

if [ "$DRY" = 1 ]; then
  echo "[dry-run] then prints the step summary, the sweep table and the main job's summary lines"
  exit "$FAILED"
fi
short_table >> "$SUMMARY"
echo
echo "== steps (logs in $DEST)"
cat "$SUMMARY"
exit "$FAILED"
