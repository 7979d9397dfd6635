#!/usr/bin/env bash
# benchmarks/gpu/tests.sh -- the GPU test tier on the lent H200, inside one device call.
#
#   bash benchmarks/gpu/tests.sh [pytest arguments...]     (default: -m gpu, every GPU test)
#
# Run from the repository root with the vLLM bundle carried (device call: carry [".gpu"]).
# Sets up the environment (benchmarks/gpu/env.sh: bundle, project, the plugin's entry point),
# then runs pytest under RUN_GUARD_S seconds in all (default 560). Writes under $OUT:
#   pytest.txt        the whole pytest output
#   *.json            per-test summaries (MOE_GRAPHS_TEST_OUT=$OUT)
#   engine-logs.txt   the moe_graphs / error lines of every engine log the tests kept
set -uo pipefail
T0=$(date +%s)
GUARD_S=${RUN_GUARD_S:-560}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# shellcheck source=benchmarks/gpu/env.sh
. benchmarks/gpu/env.sh || exit 3
export MOE_GRAPHS_TEST_OUT=$OUT
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-m gpu)
left=$((GUARD_S - ($(date +%s) - T0) - 15))
echo "[tests.sh] pytest ${args[*]} (guard ${left}s)"
timeout --kill-after=5 "$left" python3 -m pytest -v -rA --durations=0 --basetemp=/tmp/gpu-tests "${args[@]}" \
  >"$OUT/pytest.txt" 2>&1
rc=$?
for f in /tmp/gpu-tests/*/*.log /tmp/gpu-tests/*/*/*.log; do
  [ -f "$f" ] || continue
  echo "== $f"
  grep -E "moe_graphs|ENGINE_|Error|Traceback" "$f" | tail -40
done >"$OUT/engine-logs.txt" 2>&1
tail -25 "$OUT/pytest.txt"
echo "[tests.sh] pytest exit $rc after $(($(date +%s) - T0))s"
exit $rc
