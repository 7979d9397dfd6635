#!/usr/bin/env bash
# scripts/gpu_extras.sh -- the pure-Python packages vLLM 0.26 imports that the GPU bundle lacks,
# copied from this checkout's .venv into .gpu-extras/ (ignored by git; about 0.3 MiB).
#
#   bash scripts/gpu_extras.sh          then carry [".gpu", ".gpu-extras"] in device calls
#
# vLLM 0.26 validates every structured-output request by importing each backend's module, and
# backend_lm_format_enforcer evaluates `lmformatenforcer.TokenEnforcer` at class definition,
# so a request with a regex, JSON schema or grammar fails in an environment without
# lm-format-enforcer even when xgrammar serves it. A `pip install vllm==0.26.0` has it;
# ../shared/gpu's bundle does not. benchmarks/gpu/env.sh puts .gpu-extras/ on PYTHONPATH
# after the bundle, so nothing the bundle holds is shadowed.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="lmformatenforcer interegular"
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || {
  echo "scripts/gpu_extras.sh: no .venv here; run scripts/setup.sh first" >&2; exit 2; }
rm -rf .gpu-extras && mkdir -p .gpu-extras
for p in $PACKAGES; do
  [ -d "$site/$p" ] || { echo "scripts/gpu_extras.sh: $p not in $site" >&2; exit 2; }
  cp -r "$site/$p" .gpu-extras/
done
find .gpu-extras -name __pycache__ -type d -prune -exec rm -rf {} +
echo "scripts/gpu_extras.sh: .gpu-extras/ holds $PACKAGES ($(du -sh .gpu-extras | cut -f1));" \
  "carry [\".gpu\", \".gpu-extras\"]"
