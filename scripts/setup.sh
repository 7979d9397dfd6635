#!/usr/bin/env bash
# One-command setup: a virtual environment in .venv with vLLM 0.26.0 (torch 2.11.0), this plugin
# (editable) and the test tools, plus the CPU build of vLLM in .cpu-vllm for the end-to-end tests
# on machines without a GPU. Idempotent; takes ~4-6 minutes the first time (~6.5 GB download, ~9 GB on disk).
#   scripts/setup.sh            # uses python3 (>= 3.11)
#   PYTHON=python3.12 scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
quiet() {  # run "$@"; show its output (minus pip's noise about absent local indexes) only on failure
  local log; log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then grep -v "is ignored" "$log" | tail -60; rm -f "$log"; return 1; fi
  rm -f "$log"
}
"$py" -c 'import sys; assert sys.version_info >= (3, 11), f"Python >= 3.11 needed, got {sys.version}"'
if [ ! -x .venv/bin/python ]; then
  # A first install unpacks ~9 GB (torch's CUDA wheels among them); say so before pip runs out.
  free_gib=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "${free_gib:-0}" -lt 12 ]; then
    echo "[setup] warning: ${free_gib} GiB free on $(df -P . | awk 'NR==2 {print $6}'); a first install needs ~12 GiB" \
         "(.venv ~8.5 GiB, .cpu-vllm ~0.4 GiB, pip's temporary files). Free some space if pip fails with 'No space left on device'." >&2
  fi
  echo "[setup] creating .venv with $("$py" --version)"
  "$py" -m venv .venv
fi
echo "[setup] installing vllm==0.26.0, torch 2.11.0 and vllm-moe-graphs[test] (first time: minutes)"
quiet .venv/bin/python -m pip install -q --upgrade pip
quiet .venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c 'import vllm, vllm_moe_graphs; print("[setup] vllm", vllm.__version__, "| vllm_moe_graphs", vllm_moe_graphs.__version__)'
if [ -d ../shared/cpu-vllm ] && [ ! -f .cpu-vllm/.overlay-done ]; then
  echo "[setup] installing the CPU build of vLLM 0.26.0 into .cpu-vllm (end-to-end tests)"
  PYTHON=.venv/bin/python quiet bash ../shared/cpu-vllm/overlay.sh .cpu-vllm
fi
echo "[setup] done. Tests: .venv/bin/python -m pytest -q"
