"""The `h` fixture of the PagedKVStorage tests: a fresh `Harness` (tests/kv/storage_harness.py)."""

from __future__ import annotations

import pytest

from tests.kv.storage_harness import Harness


@pytest.fixture
def h() -> Harness:
    return Harness()
