#!/usr/bin/env bash
# benchmarks/gpu/run.sh -- the decode (or start-up) benchmark on the lent H200, in one device call.
#
#   bash benchmarks/gpu/run.sh [benchmarks.decode args...]
#
# Run from the repository root with the vLLM bundle carried (device call: carry [".gpu"]).
# Installs the bundle (shared/gpu/README.md recipe), installs this project, runs the GPU test tier
# (`pytest -m gpu`; "no tests collected" is fine), then `python3 -m benchmarks.decode` with
# --results-dir $OUT --log-dir /tmp/... --time-budget-s <what is left> and your arguments (yours
# come last, so they win). Everything stays under RUN_GUARD_S seconds (default 555, under the
# 9.5-minute mark of a 10-minute call). At most 8 files come back from $OUT; this writes:
#   $OUT/run.txt              everything printed (this script, pytest, benchmark)
#   $OUT/pytest.txt           the GPU test tier
#   $OUT/<name>.json, .png    the benchmark result and plot (name from --name, default "decode")
#   $OUT/worker-logs.tar.gz   one full vLLM log per model x mode, specs and raw worker results
#   $OUT/nvidia-smi.txt       the GPU at the end
# Knobs (environment): RUN_GUARD_S, PYTEST_GUARD_S (default 120), SKIP_PYTEST=1, BENCH_PROFILE=1
# (also profile each mode's batches: benchmarks/harness/profile_steps.py),
# BENCH_PROFILE_PREFILL=T,... (also profile prefill steps of T query tokens),
# BENCH_STARTUP_PROFILE=1 (trace each engine start: benchmarks/harness/startup_trace.py),
# BENCH_PIN=N (see below), and
# BENCH_GIT_COMMIT=<sha> (recorded as env.git_commit; write the sha out: a .git the device copy
# finds can be stale, so `git log` there is no source), and
# BENCH_MODULE (default benchmarks.decode; benchmarks.startup runs the start-up protocol with the
# same --results-dir/--log-dir/--time-budget-s; writes <name>.json, no plot).
set -uo pipefail
T0=$(date +%s)
GUARD_S=${RUN_GUARD_S:-555}
PYTEST_GUARD_S=${PYTEST_GUARD_S:-120}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.txt") 2>&1
left() { echo $((GUARD_S - ($(date +%s) - T0))); }
say() { echo "[run.sh +$(($(date +%s) - T0))s] $*"; }

say "repo $PWD, output $OUT, guard ${GUARD_S}s"
if [ ! -f .gpu/install.sh ]; then
  say "ERROR: .gpu/install.sh missing: make the bundle (shared/gpu/README.md) and carry .gpu"
  exit 3
fi
# shellcheck source=benchmarks/gpu/env.sh
. benchmarks/gpu/env.sh || { say "ERROR: GPU environment setup failed"; exit 3; }
python3 - <<'PY' || { echo "[run.sh] ERROR: vLLM bundle not importable"; exit 3; }
import torch, vllm, triton
print(f"[run.sh] vllm {vllm.__version__} torch {torch.__version__} triton {triton.__version__} "
      f"cuda_available {torch.cuda.is_available()}", flush=True)
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true

if [ "${SKIP_PYTEST:-0}" != 1 ]; then
  say "GPU test tier: pytest -m gpu (guard ${PYTEST_GUARD_S}s)"
  timeout --kill-after=5 "$PYTEST_GUARD_S" python3 -m pytest -m gpu -q 2>&1 | tee "$OUT/pytest.txt"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) say "pytest -m gpu: passed" ;;
    5) say "pytest -m gpu: no tests collected (fine)" ;;
    124|137) say "pytest -m gpu: TIMED OUT after ${PYTEST_GUARD_S}s" ;;
    *) say "pytest -m gpu: FAILED (exit $rc); going on with the benchmark" ;;
  esac
fi

LOGDIR=$(mktemp -d /tmp/decode-bench-XXXX)
# BENCH_PROFILE=1: each mode worker also profiles its batches
# (benchmarks/harness/profile_steps.py); the reports land in worker-logs.tar.gz as
# profile-<model>-<mode>.txt.
[ "${BENCH_PROFILE:-0}" = 1 ] && export BENCH_PROFILE_DIR=$LOGDIR
# BENCH_PROFILE_PREFILL=T1,T2,...: each mode worker also profiles prefill steps of T query
# tokens (benchmarks/harness/profile_prefill.py): profile-prefill-<model>-<mode>.txt in
# worker-logs.tar.gz.
[ -n "${BENCH_PROFILE_PREFILL:-}" ] && export BENCH_PREFILL_PROFILE_DIR=$LOGDIR
# BENCH_STARTUP_PROFILE=1: each worker traces its engine start
# (benchmarks/harness/startup_trace.py): startup-<model>-<mode>[-r<round>].txt in
# worker-logs.tar.gz.
[ "${BENCH_STARTUP_PROFILE:-0}" = 1 ] && export BENCH_STARTUP_PROFILE_DIR=$LOGDIR
BUDGET=$(( $(left) - 25 ))   # kept back: tar, nvidia-smi, tee
if [ "$BUDGET" -lt 60 ]; then
  say "ERROR: only ${BUDGET}s left for the benchmark; raise RUN_GUARD_S or skip pytest (SKIP_PYTEST=1)"
  exit 4
fi
# BENCH_PIN=N: run every mode on the same N fastest CPUs (this VM's vCPUs differ by up to 2x in
# speed, and a worker's main thread stays where it started: unpinned, the CPU lottery decides).
PIN=()
if [ "${BENCH_PIN:-0}" -gt 0 ]; then
  cpus=$(python3 benchmarks/gpu/host_probe.py --fastest "$BENCH_PIN") && PIN=(taskset -c "$cpus")
  say "pinned to CPUs ${cpus:-?} (BENCH_PIN=$BENCH_PIN)"
fi
say "benchmark: budget ${BUDGET}s, args: $*"
timeout --kill-after=10 "$((BUDGET + 10))" "${PIN[@]}" python3 -m "${BENCH_MODULE:-benchmarks.decode}" \
  --results-dir "$OUT" --log-dir "$LOGDIR" --time-budget-s "$BUDGET" "$@"
bench_rc=$?
[ $bench_rc -eq 124 ] || [ $bench_rc -eq 137 ] && say "benchmark hit the shell timeout"

tar -czf "$OUT/worker-logs.tar.gz" -C "$LOGDIR" . 2>/dev/null || say "could not pack $LOGDIR"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
say "benchmark exit $bench_rc; files in $OUT:"
ls -la "$OUT"
say "JSON/PNG: $OUT/<name>.json|png; vLLM logs: $OUT/worker-logs.tar.gz (log-<model>-<mode>.txt)"
exit $bench_rc
