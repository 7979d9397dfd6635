"""Seeding vLLM's model-info cache (integration/startup/model_info_seed.py), against the
installed vLLM 0.26.0's registry, cache reader and inspection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_moe_graphs.integration.startup import model_info_seed as seed


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    return tmp_path


def test_shipped_model_infos_are_what_vllm_computes():
    # vLLM's own inspection (the function its subprocess runs), here: a stale data file, or a
    # vLLM whose Qwen3 files changed, fails this test.
    shipped = json.loads(seed.SEEDS_FILE.read_text())
    assert shipped == seed.compute_seeds()
    assert set(shipped["models"]) == set(seed.ARCHITECTURES)


def test_seeded_cache_makes_vllms_inspection_a_hit(cache_root, monkeypatch):
    import vllm.model_executor.models.registry as registry

    assert sorted(seed.seed_model_info_cache()) == sorted(seed.ARCHITECTURES)
    files = sorted(p.name for p in (cache_root / "modelinfos").iterdir())
    assert files == ["vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json",
                     "vllm-model_executor-models-qwen3_moe-Qwen3MoeForCausalLM.json"]

    def no_subprocess(fn):
        raise AssertionError("vLLM inspected the model in a subprocess: the cache missed")

    monkeypatch.setattr(registry, "_run_in_subprocess", no_subprocess)
    shipped = json.loads(seed.SEEDS_FILE.read_text())["models"]
    for arch in seed.ARCHITECTURES:
        info = registry.ModelRegistry.models[arch].inspect_model_cls()
        assert info.architecture == arch
        assert vars(info) == shipped[arch]["modelinfo"]
    assert seed.seed_model_info_cache() == []  # valid entries are left alone


def test_nothing_seeded_unless_provably_right(cache_root, tmp_path):
    data = json.loads(seed.SEEDS_FILE.read_text())
    wrong_hash = json.loads(json.dumps(data))
    wrong_hash["models"]["Qwen3ForCausalLM"]["hash"] = "0" * 32
    wrong_class = json.loads(json.dumps(data))
    wrong_class["models"]["Qwen3MoeForCausalLM"]["class"] = "Qwen3ForCausalLM"
    other_vllm = {**data, "vllm": "0.27.0"}
    for name, doc, expect in (("hash", wrong_hash, ["Qwen3MoeForCausalLM"]),
                              ("class", wrong_class, ["Qwen3ForCausalLM"]),
                              ("vllm", other_vllm, [])):
        path = tmp_path / f"seeds-{name}.json"
        path.write_text(json.dumps(doc))
        for f in (cache_root / "modelinfos").glob("*.json"):
            f.unlink()
        assert seed.seed_model_info_cache(path) == expect, name


def test_a_broken_seed_file_is_logged_and_ignored(cache_root, tmp_path, caplog):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    assert seed.seed_model_info_cache(path) == []
    assert "model-info cache was not seeded" in caplog.text
    assert not (cache_root / "modelinfos").exists()
