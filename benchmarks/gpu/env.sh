# benchmarks/gpu/env.sh -- source from the repository root on the lent GPU machine:
#
#   . benchmarks/gpu/env.sh || exit 3
#
# Installs the vLLM bundle (shared/gpu/README.md recipe) and makes this project importable *with
# its vLLM entry point*: vLLM finds general plugins through package metadata, so a plain
# PYTHONPATH is not enough. `pip install -e .` is tried first (it needs setuptools offline); when
# it fails, a minimal .dist-info carrying the same entry point is written next to PYTHONPATH.
# Ends by checking that vLLM would load the plugin.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# An installed vLLM has its bytecode compiled (pip does it); the bundle has none, so let Python
# write it on first import: else every process, and vLLM's model-inspection subprocess, compiles
# vLLM's sources again and start-up times carry seconds no operator pays.
unset PYTHONDONTWRITEBYTECODE
eval "$(bash .gpu/install.sh install)" || { echo "[env.sh] bundle install failed"; return 3; }
if [ -d .gpu-extras ]; then  # scripts/gpu_extras.sh: what vLLM imports that the bundle lacks
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/.gpu-extras
  echo "[env.sh] .gpu-extras on PYTHONPATH: $(ls .gpu-extras | tr '\n' ' ')"
fi
if python3 -m pip install --no-deps --no-build-isolation --no-index -e . -q >/tmp/pip-e.log 2>&1
then
  echo "[env.sh] project installed (editable)"
else
  ep=/tmp/moe-graphs-entry-point
  ver=$(PYTHONPATH=$PWD python3 -c "import vllm_moe_graphs as m; print(m.__version__)")
  info=$ep/vllm_moe_graphs-$ver.dist-info
  mkdir -p "$info"
  printf 'Metadata-Version: 2.1\nName: vllm-moe-graphs\nVersion: %s\n' "$ver" >"$info/METADATA"
  printf '[vllm.general_plugins]\nmoe_graphs = vllm_moe_graphs.plugin:register\n' \
    >"$info/entry_points.txt"
  echo "[env.sh] pip install -e . failed ($(tail -1 /tmp/pip-e.log)); entry point from $info"
  export PYTHONPATH=$ep${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'PY' || { echo "[env.sh] the vLLM entry point of the plugin is not visible"; return 3; }
from importlib.metadata import entry_points
eps = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "moe_graphs"]
assert eps == ["vllm_moe_graphs.plugin:register"], eps
print("[env.sh] entry point vllm.general_plugins:moe_graphs ->", eps[0], flush=True)
PY
# ... and compile it now, like pip install does, so no start-up (and no first mode) pays it.
_t=$(date +%s)
python3 -m compileall -q -j 16 "${GPU_SITE:-/tmp/site}" >/dev/null 2>&1 || true
echo "[env.sh] bytecode compiled in $(( $(date +%s) - _t ))s"
python3 -c "import sys; print('[env.sh] bytecode: write', not sys.dont_write_bytecode, 'prefix', sys.pycache_prefix, flush=True)"
