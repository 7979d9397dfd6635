#!/usr/bin/env bash
# benchmarks/gpu/kernels.sh -- the kernel micro-benchmarks on the lent H200, inside one device
# call (run from the repository root with the vLLM bundle carried: carry [".gpu"]).
#
#   bash benchmarks/gpu/kernels.sh
#
# Runs the steps named in KERNELS_STEPS (default: all, in this order), each under its own
# timeout, everything under KERNELS_GUARD_S seconds (default 420):
#   gemm          benchmarks.kernels.gemm: the decode linears of Qwen3-0.6B / 8B / 30B-A3B at
#                 M 1, 8, 16, ours vs cuBLAS
#   gemm-sweep    benchmarks.kernels.gemm --sweep on the Qwen3-0.6B projections where cuBLAS
#                 still wins (qkv, gate_up: N > K) at M 1 and 8
#   attn-grid     benchmarks.kernels.attn: the decode grid, both shapes, batch 1..128 x context
#                 512..32k, ours vs TRITON_ATTN, FLASH_ATTN (FA3) and the HBM floor
#   attn-prefill  benchmarks.kernels.prefill: attention of steps with prefill tokens (prompts,
#                 chunks after a cached prefix, decode rows next to a prompt), ours vs FA3
#   router        benchmarks.kernels.router: Qwen3-30B-A3B's MoE routing at 1..8192 rows,
#                 vLLM's topk_softmax (+ the padding mask) vs the plugin's fused routing
#   attn-sweep-b1 benchmarks.kernels.attn --sweep at batch 1 / context 512 (splits, tiles)
# Writes $OUT/<step>.txt and $OUT/<step>.json. Never run it next to anything else on the GPU:
# these are timings.
set -uo pipefail
T0=$(date +%s)
GUARD_S=${KERNELS_GUARD_S:-420}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
left() { echo $((GUARD_S - ($(date +%s) - T0))); }
# shellcheck source=benchmarks/gpu/env.sh
. benchmarks/gpu/env.sh || exit 3
STEPS=" ${KERNELS_STEPS:-gemm gemm-sweep attn-grid attn-prefill router attn-sweep-b1} "
step() {  # step NAME SHARE_OF_LEFT_PERCENT ARGS...
  local name=$1 share=$2
  shift 2
  case "$STEPS" in *" $name "*) ;; *) return ;; esac
  local t=$(( $(left) * share / 100 ))
  if [ "$t" -lt 20 ]; then echo "[kernels.sh] skip $name: ${t}s left"; return; fi
  echo "[kernels.sh] $name (guard ${t}s): $*"
  timeout --kill-after=5 "$t" python3 "$@" --out "$OUT/$name.json" >"$OUT/$name.txt" 2>&1
  echo "[kernels.sh] $name exit $? after $(($(date +%s) - T0))s"
  tail -n 40 "$OUT/$name.txt"
}
step gemm 15 -m benchmarks.kernels.gemm --ms 1,8,16
step gemm-sweep 30 -m benchmarks.kernels.gemm --ms 1,8 --shapes qwen3-0.6b/qkv,qwen3-0.6b/gate_up \
  --sweep --sweep-ms 1,8 --sweep-block-n 16,32 --sweep-block-k 128,256 --sweep-splits 1,2 \
  --sweep-num-warps 4 --sweep-num-stages 3 --sweep-swap-ab 0,1
step attn-grid 70 -m benchmarks.kernels.attn --batches 1,8,32,64,128 --contexts 512,2048,8192,32768
step attn-prefill 70 -m benchmarks.kernels.prefill
step router 50 -m benchmarks.kernels.router
step attn-sweep-b1 100 -m benchmarks.kernels.attn --models qwen3-0.6b --batches 1 \
  --contexts 512 --sweep --sweep-block-n 16,32,64 --sweep-num-warps 2,4 --sweep-num-stages 2 \
  --sweep-splits auto,4,8,16,32
echo "[kernels.sh] done after $(($(date +%s) - T0))s"
