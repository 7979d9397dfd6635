"""Patch: the model runner's `model` attribute, for the length of one precapture dummy batch.

Why: with `precapture: true` each graph key is captured at start-up on a batch that vLLM's own
`GPUModelRunner._dummy_run` prepares (padded inputs, attention metadata, forward context);
`_dummy_run` then calls `self.model(...)` directly, so the capture must stand where the model
is for that call.
How: `swapped(runner, stand_in)` sets `runner.model` to the stand-in (`precapture.
PrecaptureModel`, which captures the key and forwards every other attribute to the real model)
inside a `with` block and restores the real model on exit, also when the block raises; yields
the real model.
Removal: when vLLM's dummy run can call a capture hook (or the plugin prepares precapture
batches itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def swapped(runner: Any, stand_in: Any) -> Iterator[Any]:
    real = runner.model
    runner.model = stand_in
    try:
        yield real
    finally:
        runner.model = real
