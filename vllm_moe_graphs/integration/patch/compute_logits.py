"""Patch: `compute_logits` of the one loaded model object (an instance attribute).

Why: with `logits_in_graph` the decode graph computes the logits inside the forward
(`integration/model/graph_logits.py`); vLLM's runner then calls `model.compute_logits(hidden)` after
the forward, and must receive those logits instead of computing them again.
How: `install` sets an instance attribute that shadows the class method for this model object
only (no class, no other model changes); the replacement returns the graph's logits for the
exact view it handed over and calls the original bound method for anything else. `uninstall`
removes the attribute.
Removal: when vLLM's runner lets a graph's output include the logits (its FULL graphs compute
them outside).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ATTRIBUTE = "compute_logits"


def install(model: Any, replacement: Callable[..., Any]) -> Callable[..., Any]:
    """Shadow `model.compute_logits` with `replacement`; returns the original bound method."""
    original = getattr(model, ATTRIBUTE)
    setattr(model, ATTRIBUTE, replacement)
    return original


def uninstall(model: Any, replacement: Callable[..., Any]) -> None:
    """Remove the shadowing attribute when it is still `replacement`."""
    if model.__dict__.get(ATTRIBUTE) == replacement:
        delattr(model, ATTRIBUTE)
