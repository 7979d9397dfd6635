#!/usr/bin/env bash
# benchmarks/gpu/kernels.sh -- the kernel micro-benchmarks on the lent H200, inside one device
# call (run from the repository root with the vLLM bundle carried: carry [".gpu"]).
#
#   bash benchmarks/gpu/kernels.sh
#
# Runs, each under its own timeout, everything under KERNELS_GUARD_S seconds (default 240):
#   1. benchmarks.gemm_kernels  the Qwen3-0.6B / 8B linears at M 1, 8, 16: ours (split reduce in
#      its launch, and the two-launch path), cuBLAS, and the down_proj + SiLU-and-mul tail;
#   2. benchmarks.attn_kernels  our decode attention vs TRITON_ATTN, both shapes, batch
#      1..64, context 512 / 4096 (ours as the backend runs it, and the two-launch split path);
#   3. benchmarks.attn_kernels --sweep at batch 1 / context 512 over splits and tile sizes.
# Writes $OUT/gemm-kernels.{txt,json}, attn-kernels.{txt,json}, attn-sweep-b1.{txt,json}.
# Never run it next to anything else on the GPU: these are timings.
set -uo pipefail
T0=$(date +%s)
GUARD_S=${KERNELS_GUARD_S:-240}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
left() { echo $((GUARD_S - ($(date +%s) - T0))); }
# shellcheck source=benchmarks/gpu/env.sh
. benchmarks/gpu/env.sh || exit 3
step() {  # step NAME SHARE_OF_LEFT_PERCENT ARGS...
  local name=$1 share=$2
  shift 2
  local t=$(( $(left) * share / 100 ))
  if [ "$t" -lt 20 ]; then echo "[kernels.sh] skip $name: ${t}s left"; return; fi
  echo "[kernels.sh] $name (guard ${t}s): $*"
  timeout --kill-after=5 "$t" python3 "$@" --out "$OUT/$name.json" >"$OUT/$name.txt" 2>&1
  echo "[kernels.sh] $name exit $? after $(($(date +%s) - T0))s"
  tail -n 40 "$OUT/$name.txt"
}
step gemm-kernels 35 -m benchmarks.gemm_kernels --ms 1,8,16 \
  --shapes qwen3-0.6b/qkv,qwen3-0.6b/o_proj,qwen3-0.6b/gate_up,qwen3-0.6b/down,qwen3-8b/o_proj,qwen3-8b/down,qwen3-30b-a3b/o_proj
step attn-kernels 55 -m benchmarks.attn_kernels --batches 1,8,32,64 --contexts 512,4096
step attn-sweep-b1 100 -m benchmarks.attn_kernels --models qwen3-0.6b --batches 1 \
  --contexts 512 --sweep --sweep-block-n 16,32,64 --sweep-num-warps 2,4 --sweep-num-stages 2 \
  --sweep-splits auto,4,8,16,32
echo "[kernels.sh] done after $(($(date +%s) - T0))s"
