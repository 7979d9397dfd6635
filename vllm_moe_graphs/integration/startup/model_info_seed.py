"""Seeds vLLM's model-info cache for Qwen3 and Qwen3-MoE, so that a first start on a fresh node
or container skips vLLM's model-inspection subprocess.

vLLM 0.26 resolves a model's architecture (`ModelConfig` -> `ModelRegistry.inspect_model_cls`)
by importing the model class in a *subprocess* (to keep CUDA out of the calling process), and
caches the result in `$VLLM_CACHE_ROOT/modelinfos/<module>-<class>.json`, keyed by a hash of the
model's source file. With an empty cache that subprocess imports vLLM and torch again: 15-17 s of
a cold start on the lent H200's host (a `BENCH_STARTUP_PROFILE=1` trace, in git history), paid by
every container start that does not keep `VLLM_CACHE_ROOT` on a volume.

`model_infos.json` (beside this file) holds, for the architectures the plugin serves, what
vLLM 0.26.0's own inspection computes (`_ModelInfo.from_model_cls`) and the hash of the model
file it was computed from. At registration the plugin writes an entry, with vLLM's own cache
writer, only when: vLLM is 0.26.0, the registry still lists the architecture as the same
lazily-registered module and class, the installed model file has exactly the recorded hash, and
vLLM's cache has no valid entry for it. A byte-identical model file yields the same model info,
which is all vLLM's own cache relies on too; anything else leaves vLLM to inspect as usual.
Any error here is logged and ignored: this only saves time.

Regenerate the data (after a vLLM upgrade):
`python -m vllm_moe_graphs.integration.startup.model_info_seed --write`;
tests/integration/startup/test_model_info_seed.py fails while it is stale.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllm.moe_graphs")

SEEDS_FILE = Path(__file__).with_name("model_infos.json")
ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _registry() -> tuple[Any, Any, Any, Path]:
    import vllm.model_executor.models.registry as registry
    from vllm.model_executor.models.registry import (
        ModelRegistry,
        _LazyRegisteredModel,
        _ModelInfo,
    )

    return ModelRegistry, _LazyRegisteredModel, _ModelInfo, Path(registry.__file__).parent


def _lazy_model(arch: str) -> tuple[Any, str] | None:
    """vLLM's registry entry for `arch` and its model file's hash, when it is a lazily
    registered model of vLLM's own models directory; else None."""
    registry, lazy_cls, _, models_dir = _registry()
    model = registry.models.get(arch)
    if not isinstance(model, lazy_cls):
        return None
    path = models_dir / f"{model.module_name.rsplit('.', 1)[-1]}.py"
    if not (model.module_name.startswith("vllm.model_executor.models.") and path.is_file()):
        return None
    return model, model._get_modelinfo_module_hash(path)


def compute_seeds() -> dict[str, Any]:
    """What vLLM's inspection computes for `ARCHITECTURES`, here and now (imports the model
    classes: run it apart from serving)."""
    from vllm_moe_graphs.integration.signatures import vllm_version

    _, _, info_cls, _ = _registry()
    models = {}
    for arch in ARCHITECTURES:
        found = _lazy_model(arch)
        if found is None:
            raise RuntimeError(f"{arch} is not a lazily registered vLLM model here")
        model, digest = found
        models[arch] = {"module": model.module_name, "class": model.class_name, "hash": digest,
                        "modelinfo": asdict(info_cls.from_model_cls(model.load_model_cls()))}
    return {"vllm": vllm_version(), "models": models}


def seed_model_info_cache(seeds_file: Path = SEEDS_FILE) -> list[str]:
    """Write vLLM's model-info cache entries that are missing and provably right; returns the
    architectures written."""
    try:
        from vllm_moe_graphs.integration.signatures import vllm_version

        seeds = json.loads(seeds_file.read_text())
        if seeds.get("vllm") != vllm_version():
            return []
        _, _, info_cls, _ = _registry()
        written = []
        for arch, entry in seeds["models"].items():
            found = _lazy_model(arch)
            if found is None:
                continue
            model, digest = found
            if ((model.module_name, model.class_name) != (entry["module"], entry["class"])
                    or digest != entry["hash"]
                    or model._load_modelinfo_from_cache(digest) is not None):
                continue
            model._save_modelinfo_to_cache(info_cls(**entry["modelinfo"]), digest)
            written.append(arch)
        return written
    except Exception as exc:  # noqa: BLE001 - a time saver only: vLLM inspects as usual
        logger.warning("moe_graphs: vLLM's model-info cache was not seeded (%s: %s); vLLM "
                       "inspects the model itself", type(exc).__name__, exc)
        return []


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    seeds = compute_seeds()
    text = json.dumps(seeds, indent=1, sort_keys=True) + "\n"
    if args == ["--write"]:
        SEEDS_FILE.write_text(text)
        print(f"wrote {SEEDS_FILE}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
