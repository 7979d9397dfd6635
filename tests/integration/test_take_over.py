"""`hooks.take_over_decode_graphs`: what the plugin edits in a not yet finalised VllmConfig."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm.v1.attention.backends.registry")
from vllm.config.compilation import CompilationMode, CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from vllm_moe_graphs.integration import hooks  # noqa: E402


def _config(worker_cls="auto", backend=None, mode=None, cudagraph_mode=None):
    """The three sub-configs the take-over reads, as they are before `__post_init__`."""
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(worker_cls=worker_cls),
        attention_config=types.SimpleNamespace(backend=backend),
        compilation_config=types.SimpleNamespace(mode=mode, cudagraph_mode=cudagraph_mode))


@pytest.fixture(autouse=True)
def _no_runner_env(monkeypatch):
    monkeypatch.delenv(hooks.V1_RUNNER_ENV, raising=False)


def test_defaults_are_taken_over(monkeypatch):
    cfg = _config()
    edits, conflicts = hooks.take_over_decode_graphs(cfg)
    assert conflicts == []
    assert cfg.parallel_config.worker_cls == hooks.WORKER_CLS
    assert cfg.attention_config.backend is AttentionBackendEnum.CUSTOM
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.NONE
    assert cfg.compilation_config.mode is CompilationMode.NONE
    import os

    assert os.environ[hooks.V1_RUNNER_ENV] == "0"
    assert len(edits) == 5
    # idempotent: a second pass (e.g. a config rebuilt from the edited one) edits nothing
    assert hooks.take_over_decode_graphs(cfg) == ([], [])


@pytest.mark.parametrize("level,mode,cudagraph_mode,chosen", [
    (2, None, None, ""),  # vLLM's defaults: the plugin replaces them (documented)
    (2, CompilationMode.NONE, CUDAGraphMode.NONE, ""),  # the plugin's explicit route
    (2, CompilationMode.NONE, None, ""),  # no torch.compile, as the plugin runs
    (3, None, None, "-O3"),
    (0, None, None, "-O0"),
    (2, CompilationMode.VLLM_COMPILE, None, "-cc.mode=VLLM_COMPILE"),
    (2, None, CUDAGraphMode.FULL_DECODE_ONLY, "-cc.cudagraph_mode=FULL_DECODE_ONLY"),
    (1, CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE,
     "-O1 -cc.mode=VLLM_COMPILE -cc.cudagraph_mode=PIECEWISE"),
])
def test_user_compilation_choices(level, mode, cudagraph_mode, chosen):
    from vllm_moe_graphs.integration.config_facts import user_compilation

    assert user_compilation(level, mode, cudagraph_mode) == chosen


@pytest.mark.parametrize("change,conflict", [
    (dict(worker_cls="my.pkg.Worker"), "--worker-cls my.pkg.Worker"),
    (dict(backend=AttentionBackendEnum.TRITON_ATTN), "--attention-backend TRITON_ATTN"),
])
def test_conflicting_user_choice_leaves_config_untouched(change, conflict):
    cfg = _config(**change)
    before = repr(cfg)
    edits, conflicts = hooks.take_over_decode_graphs(cfg)
    assert edits == [] and conflicts == [conflict]
    assert repr(cfg) == before


def test_v2_runner_forced_by_user_is_a_conflict(monkeypatch):
    monkeypatch.setenv(hooks.V1_RUNNER_ENV, "1")
    cfg = _config()
    edits, conflicts = hooks.take_over_decode_graphs(cfg)
    assert edits == [] and conflicts == [f"{hooks.V1_RUNNER_ENV}=1"]
    assert cfg.parallel_config.worker_cls == "auto"


def test_explicit_flag_route_needs_no_edit_but_the_env(monkeypatch):
    monkeypatch.setenv(hooks.V1_RUNNER_ENV, "0")
    cfg = _config(worker_cls=hooks.WORKER_CLS, backend=AttentionBackendEnum.CUSTOM,
                  mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.NONE)
    assert hooks.take_over_decode_graphs(cfg) == ([], [])
