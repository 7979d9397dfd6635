#!/usr/bin/env bash
# benchmarks/gpu/tests.sh -- the GPU test tier on the lent H200, inside one device call.
#
#   bash benchmarks/gpu/tests.sh [pytest arguments...]     (default: -m gpu, every GPU test)
#   bash benchmarks/gpu/tests.sh ARGS... + ARGS... [+ ...]  (lanes: one pytest each, at once)
#   bash benchmarks/gpu/tests.sh tier                     (every GPU test but the FP8 ones in
#                                                          eight lanes, under 9 minutes on an H100)
#   bash benchmarks/gpu/tests.sh fp8                      (the FP8 KV cache's and the block-FP8
#                                                          weights' parity and numerics)
#
# Run from the repository root with the vLLM bundle carried (device call: carry [".gpu",
# ".gpu-extras"]; .gpu-extras from scripts/gpu_extras.sh, for the sampling test's structured
# output).
# Sets up the environment (benchmarks/gpu/env.sh: bundle, project, the plugin's entry point),
# then runs pytest under RUN_GUARD_S seconds in all (default 560).
#
# Lanes: a lone `+` splits the arguments into lanes that run side by side on the one GPU (the
# end-to-end tests are host-bound, one core per engine: lanes fit several into one call); a
# lane's leading NAME=value arguments are environment for that lane's pytest only. Each
# lane's engines then get a fixed KV cache (MOE_GRAPHS_TEST_KV_CACHE_GIB, default 4) instead of
# a profiled share, see tests/gpu_util.engine_memory_kwargs. Never use lanes for timings.
# Each lane's engines also take their torch.distributed port from a range of their own
# (VLLM_PORT=20000 + 1000 x lane, below Linux's ephemeral ports; vLLM scans up from it to the
# first free one): vLLM's default asks the kernel for a free port and binds it later, and
# lanes starting engines in the same second can lose that race (EADDRINUSE at an engine's
# start, a failed test that says nothing about the plugin). And an engine's sleep or wake-up
# excludes the other lanes' engine starts, sleeps and wake-ups (GPU_LANES_LOCK, see
# tests/gpu_util.py): vLLM's sleep asserts that the device's free memory did not drop meanwhile.
#
# Writes under $OUT:
#   pytest.txt (one lane) or pytest-<lane>.txt    the whole pytest output
#   summaries.tar.gz  the per-test summaries, *.json (MOE_GRAPHS_TEST_OUT=$OUT)
#   engine-logs.txt   the moe_graphs / error lines of every engine log the tests kept
set -uo pipefail
T0=$(date +%s)
GUARD_S=${RUN_GUARD_S:-560}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# shellcheck source=benchmarks/gpu/env.sh
. benchmarks/gpu/env.sh || exit 3
export MOE_GRAPHS_TEST_OUT=$OUT
if [ "${1:-}" = tier ]; then
  # the whole tier, balanced by the tests' durations on the H100 and H200 (the engine parity
  # tests of the two shapes are the longest, 4.5-6 minutes each with lanes sharing the GPU;
  # the unit, kernel, backend and sampling tests took ~9 minutes in one lane on the H100, so
  # the backend's engine tests and the sampling test have a lane of their own)
  P=tests/graphs/test_gpu_parity.py F=tests/graphs/test_gpu_faults.py
  S=tests/graphs/test_gpu_serve.py
  # the numerics test beside the other lanes: Qwen3-30B-A3B cut to 12 of its 48 layers (all 48
  # are ~61 GB of weights, more than an H100 holds beside the other lanes)
  export MOE_GRAPHS_TEST_NUMERICS_LAYERS=${MOE_GRAPHS_TEST_NUMERICS_LAYERS:-'{"qwen3-30b-a3b": 12}'}
  set -- -m gpu tests/test_gpu_plugin.py tests/ops tests/graphs/test_gpu_runner.py \
    tests/graphs/test_gpu_sampler_graphs.py tests/integration + -m gpu tests/attention tests/graphs/test_gpu_sampling.py \
    + -m gpu tests/graphs/test_gpu_numerics.py tests/graphs/test_gpu_refusals.py \
    + -m gpu "$P::test_graphs_match_kill_switch_eager[qwen3-0.6b]" \
    "$P::test_parallel_warm_up_compiles_keep_parity_and_compile_nothing_late" \
    + -m gpu "$P::test_graphs_match_kill_switch_eager[qwen3-30b-a3b]" \
    + -m gpu "$S::test_kill_file_under_load_through_vllm_serve" \
    "$F::test_disable_env_runs_stock_vllm" "$F::test_capture_failure_and_memory_budget_keep_serving" \
    "$P::test_mixed_precapture_serves_mixed_traffic_without_capture" \
    "$S::test_idle_capture_captures_while_idle_then_serves_without_capture" \
    "$P::test_mixed_graphs_with_flash_attn_prefill_match_kill_switch_eager" \
    "$P::test_wide_batches_replay_and_match_kill_switch" \
    + -m gpu "$P::test_uva_expert_offload_graphs_match_kill_switch_eager" \
    "$P::test_precapture_serves_from_start_up_graphs" "$P::test_experimental_kernels_keep_parity" \
    "$S::test_idle_capture_recaptures_after_wake_up_through_vllm_serve" \
    "$P::test_mixed_graphs_with_fused_moe_routing_match_kill_switch_eager" \
    + -m gpu "$P::test_mixed_graphs_match_kill_switch_eager" \
    "$F::test_mixed_traffic_faults_keep_output_identical" \
    "$S::test_mixed_traffic_faults_through_vllm_serve" \
    "$P::test_tiny_checkpoint_graphs_match_kill_switch_eager"
fi
if [ "${1:-}" = fp8 ]; then
  # the FP8 proofs, beside the tier (which fills a call), taken over unproven (MOE_GRAPHS_UNPROVEN
  # fp8_kv, fp8): mixed parity of both shapes on an FP8 KV cache and on block-FP8 checkpoints,
  # and the numerics test on each (Qwen3-30B-A3B cut to 12 of its 48 layers)
  P=tests/graphs/test_gpu_parity.py
  export MOE_GRAPHS_TEST_NUMERICS_LAYERS=${MOE_GRAPHS_TEST_NUMERICS_LAYERS:-'{"qwen3-30b-a3b": 12}'}
  set -- -m gpu "$P::test_mixed_graphs_on_an_fp8_kv_cache_match_kill_switch_eager" \
    + MOE_GRAPHS_TEST_NUMERICS_KV_CACHE_DTYPE=fp8 -m gpu tests/graphs/test_gpu_numerics.py \
    + -m gpu tests/graphs/test_gpu_fp8_weights.py \
    + MOE_GRAPHS_TEST_NUMERICS_WEIGHTS=fp8_block -m gpu tests/graphs/test_gpu_numerics.py
fi
lanes=() lane_envs=() cur="" env=""
for a in "$@"; do
  if [ "$a" = "+" ]; then
    lanes+=("$cur"); lane_envs+=("$env"); cur=""; env=""
  elif [ -z "$cur" ] && [[ "$a" =~ ^[A-Z_][A-Z0-9_]*= ]]; then
    env+="$(printf '%q ' "$a")"
  else
    cur+="$(printf '%q ' "$a")"
  fi
done
lanes+=("$cur"); lane_envs+=("$env")
[ ${#lanes[@]} -eq 1 ] && [ -z "${lanes[0]}" ] && lanes=("-m gpu")
if [ ${#lanes[@]} -gt 1 ]; then
  export MOE_GRAPHS_TEST_KV_CACHE_GIB=${MOE_GRAPHS_TEST_KV_CACHE_GIB:-4}
  export GPU_LANES_LOCK=${GPU_LANES_LOCK:-$(mktemp /tmp/gpu-lanes-XXXX.lock)}
fi
left=$((GUARD_S - ($(date +%s) - T0) - 15))
pids=()
for i in "${!lanes[@]}"; do
  name=pytest; base=/tmp/gpu-tests; port=
  if [ ${#lanes[@]} -gt 1 ]; then
    name=pytest-$i; base=/tmp/gpu-tests-$i; port="VLLM_PORT=$((20000 + 1000 * i))"
  fi
  echo "[tests.sh] lane $i: ${lane_envs[$i]}pytest ${lanes[$i]} (guard ${left}s${port:+, $port})" \
    "-> $name.txt"
  eval "$port ${lane_envs[$i]}timeout --kill-after=5 $left python3 -m pytest -v -rA \
    --durations=0 --basetemp=$base ${lanes[$i]}" >"$OUT/$name.txt" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; r=$?
  echo "[tests.sh] lane $i: pytest exit $r after $(($(date +%s) - T0))s"
  [ $r -ne 0 ] && rc=$r
done
for f in /tmp/gpu-tests*/*/*.log /tmp/gpu-tests*/*/*/*.log; do
  [ -f "$f" ] || continue
  echo "== $f"
  grep -E "moe_graphs|ENGINE_|Error|Traceback|JIT compilation" "$f" | tail -40
done >"$OUT/engine-logs.txt" 2>&1
# At most 8 files come back from a device call: the per-test summaries travel as one archive.
if compgen -G "$OUT/*.json" >/dev/null; then
  tar -czf "$OUT/summaries.tar.gz" -C "$OUT" $(cd "$OUT" && ls *.json) && rm -f "$OUT"/*.json
fi
for f in "$OUT"/pytest*.txt; do echo "== $f"; tail -15 "$f"; done
echo "[tests.sh] exit $rc after $(($(date +%s) - T0))s"
exit $rc
