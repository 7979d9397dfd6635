"""Model *shapes* shipped with the package: config directories for vLLM's dummy weights."""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

SHAPES = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")


def shape_dir(name: str) -> str:
    """Directory holding `config.json` of a shipped shape."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; shipped shapes: {', '.join(SHAPES)}")
    return str(resources.files(__package__) / name)


def resolve_model(model: str) -> str:
    """A shipped shape name -> its directory; anything else is returned unchanged."""
    return shape_dir(model) if model in SHAPES else model


def read_hf_config(model: str) -> dict[str, Any]:
    """The model's `config.json` as a dict, from a directory or a shipped shape name.

    Raises `ValueError` naming the path when there is no readable config.json."""
    path = resolve_model(model)
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise ValueError(
            f"{model!r} is not a model directory with a config.json (looked for {cfg!r}); give "
            f"a local checkpoint or config directory, or a shipped shape: {', '.join(SHAPES)}"
        )
    with open(cfg) as f:
        return json.load(f)
