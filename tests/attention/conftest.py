"""The `env` fixture of the attention backend's CPU tests: vLLM's objects built on CPU
(tests/attention/backend_env.py), one set per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """`backend_env.make_env` in a temporary model directory, one per test module."""
    from tests.attention.backend_env import make_env

    return make_env(tmp_path_factory.mktemp("qwen3-tiny"))
