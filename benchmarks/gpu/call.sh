#!/usr/bin/env bash
# benchmarks/gpu/call.sh -- several GPU jobs in one device call, each with its share of the time.
#
#   TESTS_ARGS=tier SERVE_ARGS="--model qwen3-0.6b ..." bash benchmarks/gpu/call.sh
#
# Run from the repository root with the vLLM bundle carried (device call: carry [".gpu"]).
# Each part runs only when its variable is set, in this order, under CALL_GUARD_S seconds in all
# (default 575, under a 10-minute call):
#   TESTS_ARGS      arguments of benchmarks/gpu/tests.sh (e.g. `tier`), guard TESTS_GUARD_S (450)
#   KERNELS_STEPS   steps of benchmarks/gpu/kernels.sh, guard KERNELS_GUARD_S (150)
#   DECODE_ARGS     arguments of benchmarks/gpu/run.sh (benchmarks.decode, or DECODE_MODULE, e.g.
#                   benchmarks.startup), SKIP_PYTEST=1; keeps AFTER_DECODE_S (20) for what follows
#   SERVE_ARGS      arguments of benchmarks/gpu/run.sh with BENCH_MODULE=benchmarks.serving; keeps
#                   AFTER_SERVE_S (0) for what follows
#   SERVE2_ARGS     a second serving run (another shape or mode set): $OUT/serve2.tgz
#   PLUGIN_CONFIG   JSON of moe_graphs settings for every plugin mode of both serving runs
#                   (their --plugin-config, passed as one argument: spaces are fine)
# The benchmark parts get --time-budget-s from what is left. A device call brings back at most 8
# files: each part's output folder comes back as one archive, $OUT/{tests,kernels,decode,serve}.tgz
# and the benchmarks' JSON and PNG files also as they are. Each part is archived as soon as it
# ends, so a call cut short by the device's limit still brings back the parts that finished.
set -uo pipefail
T0=$(date +%s)
GUARD_S=${CALL_GUARD_S:-575}
FINAL=${OUT:-$PWD/out}
WORK=$(mktemp -d /tmp/gpu-call-XXXX)
mkdir -p "$FINAL"
left() { echo $((GUARD_S - ($(date +%s) - T0))); }
say() { echo "[call.sh +$(($(date +%s) - T0))s] $*"; }
keep() {  # keep PART: its folder as $FINAL/PART.tgz, its JSON and PNG files as they are
  [ -d "$WORK/$1" ] || return 0
  tar -czf "$FINAL/$1.tgz" -C "$WORK" "$1"
  case $1 in
    decode | serve*) cp "$WORK/$1"/*.json "$WORK/$1"/*.png "$FINAL/" 2>/dev/null ;;
  esac
  return 0
}

if [ -n "${TESTS_ARGS:-}" ]; then
  mkdir -p "$WORK/tests"
  # shellcheck disable=SC2086  # the arguments are a list
  OUT=$WORK/tests RUN_GUARD_S=${TESTS_GUARD_S:-450} bash benchmarks/gpu/tests.sh $TESTS_ARGS 2>&1 \
    | tail -30
  grep -hE "^(PASSED|FAILED|ERROR) |[0-9]+ (passed|failed)" "$WORK"/tests/pytest*.txt | tail -80
  keep tests
  say "tests done"
fi
if [ -n "${KERNELS_STEPS:-}" ]; then
  mkdir -p "$WORK/kernels"
  OUT=$WORK/kernels KERNELS_GUARD_S=${KERNELS_GUARD_S:-150} bash benchmarks/gpu/kernels.sh 2>&1 \
    | tail -80
  keep kernels
  say "kernels done"
fi
if [ -n "${DECODE_ARGS:-}" ]; then
  mkdir -p "$WORK/decode"
  budget=$(( $(left) - ${AFTER_DECODE_S:-20} ))
  if [ "$budget" -gt 90 ]; then
    # shellcheck disable=SC2086
    OUT=$WORK/decode RUN_GUARD_S=$budget BENCH_MODULE=${DECODE_MODULE:-benchmarks.decode} \
      SKIP_PYTEST=1 bash benchmarks/gpu/run.sh $DECODE_ARGS --time-budget-s $((budget - 20)) 2>&1 \
      | tail -40
  else
    say "decode skipped: ${budget}s left"
  fi
  keep decode
  say "decode done"
fi
serve() {  # serve PART ARGS KEEP_S: one serving run, leaving KEEP_S seconds for what follows
  mkdir -p "$WORK/$1"
  budget=$(( $(left) - 20 - $3 ))
  local extra=()
  [ -n "${PLUGIN_CONFIG:-}" ] && extra=(--plugin-config "$PLUGIN_CONFIG")
  # shellcheck disable=SC2086
  OUT=$WORK/$1 RUN_GUARD_S=$budget BENCH_MODULE=benchmarks.serving SKIP_PYTEST=1 \
    bash benchmarks/gpu/run.sh $2 "${extra[@]}" --time-budget-s $((budget - 15)) 2>&1 | tail -60
  keep "$1"
  say "$1 done"
}
[ -n "${SERVE_ARGS:-}" ] && serve serve "$SERVE_ARGS" "${AFTER_SERVE_S:-0}"
[ -n "${SERVE2_ARGS:-}" ] && serve serve2 "$SERVE2_ARGS" 0
say "done; files in $FINAL: $(cd "$FINAL" && ls | tr '\n' ' ')"
