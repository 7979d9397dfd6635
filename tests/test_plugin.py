"""The entry point: registration, rollback, start-up validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.serve_util import cpu_env


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 300):
    """Run `code` in a fresh interpreter whose environment carries no MOE_GRAPHS_* variable
    unless `env` says so (this test process may have loaded the plugin and exported its metrics
    dir)."""
    if env is None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MOE_GRAPHS_") and k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("moe_graphs") == "vllm_moe_graphs.plugin:register"


def test_module_import_is_light():
    proc = _python("""
        import sys
        import vllm_moe_graphs.plugin, vllm_moe_graphs.envs, vllm_moe_graphs.config
        import vllm_moe_graphs.capability, vllm_moe_graphs.killswitch
        heavy = [m for m in ("torch", "vllm", "triton", "transformers") if m in sys.modules]
        print(heavy)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_register_is_idempotent_and_patches(monkeypatch, tmp_path):
    monkeypatch.delenv("MOE_GRAPHS_DISABLE", raising=False)
    proc = _python(f"""
        import logging, os
        os.environ["VLLM_CACHE_ROOT"] = {str(tmp_path)!r}
        from vllm_moe_graphs.plugin import register
        from vllm_moe_graphs.integration.patch import PATCHED_ATTR
        register(); register()
        from vllm.v1.worker.worker_base import WorkerBase
        from vllm.platforms import current_platform
        print(getattr(WorkerBase.__init__, PATCHED_ATTR, False),
              getattr(type(current_platform).check_and_update_config, PATCHED_ATTR, False),
              bool(os.environ.get("MOE_GRAPHS_METRICS_DIR")))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-3:] == ["True", "True", "True"]
    assert proc.stdout.count("registered in process MainProcess") == 1
    # an empty vLLM cache: the model-info entries of the served architectures were written
    assert ("vLLM's model-info cache seeded for Qwen3ForCausalLM, Qwen3MoeForCausalLM"
            in proc.stdout + proc.stderr)
    assert len(list((tmp_path / "modelinfos").glob("*.json"))) == 2


def test_disable_registers_and_patches_nothing(tmp_path):
    proc = _python(f"""
        import os
        os.environ["MOE_GRAPHS_DISABLE"] = "1"
        os.environ["VLLM_CACHE_ROOT"] = {str(tmp_path)!r}
        import vllm.logger  # vLLM's log handler, as in every vLLM process
        from vllm_moe_graphs.plugin import register
        register()
        from vllm_moe_graphs.integration.patch import PATCHED_ATTR
        from vllm.v1.worker.worker_base import WorkerBase
        from vllm.platforms import current_platform
        print(getattr(WorkerBase.__init__, PATCHED_ATTR, False),
              getattr(type(current_platform).check_and_update_config, PATCHED_ATTR, False),
              "MOE_GRAPHS_METRICS_DIR" in os.environ)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-3:] == ["False", "False", "False"]
    assert "MOE_GRAPHS_DISABLE=1, nothing registered" in proc.stdout + proc.stderr
    assert not (tmp_path / "modelinfos").exists()  # vLLM's cache untouched


def test_bad_env_value_fails_registration():
    proc = _python("""
        import os
        os.environ["MOE_GRAPHS_DISABLE"] = "yes please"
        from vllm_moe_graphs.plugin import register
        register()
    """)
    assert proc.returncode != 0
    assert "MOE_GRAPHS_DISABLE='yes please'" in proc.stderr and "accepted" in proc.stderr


_DUMP_CONFIG = """
    import json, sys
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=sys.argv[1], max_model_len=256, dtype="bfloat16",
                      additional_config={"moe_graphs": {"warmup_steps": 3}})
    cfg = args.create_engine_config()
    from vllm_moe_graphs.integration.patch import PATCHED_ATTR
    from vllm.v1.worker.worker_base import WorkerBase
    print("CONFIG=" + json.dumps({
        "hash": cfg.compute_hash(),
        "worker_cls": cfg.parallel_config.worker_cls,
        "worker_extension_cls": cfg.parallel_config.worker_extension_cls,
        "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
        "compilation_mode": str(cfg.compilation_config.mode),
        "cudagraph_capture_sizes": cfg.compilation_config.cudagraph_capture_sizes,
        "attention_backend": str(cfg.attention_config.backend),
        "enforce_eager": cfg.model_config.enforce_eager,
        "block_size": cfg.cache_config.block_size,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "additional_config": cfg.additional_config,
        "patched": getattr(WorkerBase.__init__, PATCHED_ATTR, False),
    }, sort_keys=True, default=str))
"""


def _engine_config(model: str, cpu_vllm: str, **env: str) -> dict:
    proc = _python(_DUMP_CONFIG.replace("sys.argv[1]", repr(model)), env=cpu_env(cpu_vllm, **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CONFIG=")][-1]
    return json.loads(line.removeprefix("CONFIG="))


@pytest.mark.e2e
def test_rollback_config_identical_to_no_plugin(tiny_qwen3, cpu_vllm):
    """MOE_GRAPHS_DISABLE=1 builds exactly the engine config vLLM builds without the plugin
    (VLLM_PLUGINS="" loads no general plugin: as if it were not installed)."""
    disabled = _engine_config(tiny_qwen3, cpu_vllm, MOE_GRAPHS_DISABLE="1")
    no_plugin = _engine_config(tiny_qwen3, cpu_vllm, VLLM_PLUGINS="")
    assert disabled == no_plugin
    assert disabled["patched"] is False
    enabled = _engine_config(tiny_qwen3, cpu_vllm)
    assert enabled["patched"] is True  # the comparison above is not between two no-ops
