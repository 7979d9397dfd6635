"""Checks that the private vLLM APIs we touch still have the shape this code was written for."""

from __future__ import annotations

import inspect
from collections.abc import Callable

SUPPORTED_VLLM = "0.26.0"


class IncompatibleVllmError(RuntimeError):
    """A private vLLM API changed; the plugin refuses to patch it."""


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def version_supported(version: str) -> bool:
    return version.split("+", 1)[0] == SUPPORTED_VLLM


def check_parameters(qualname: str, fn: Callable, expected: tuple[str, ...]) -> None:
    """Raise `IncompatibleVllmError` unless `fn` takes exactly `expected` parameters."""
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:  # pragma: no cover - builtins only
        raise IncompatibleVllmError(f"cannot inspect {qualname}: {exc}") from exc
    if params != expected:
        raise IncompatibleVllmError(
            f"vllm_moe_graphs supports vLLM {SUPPORTED_VLLM}; found vLLM {vllm_version()} where "
            f"{qualname} takes {params}, expected {expected}. Set MOE_GRAPHS_DISABLE=1 to run "
            f"stock vLLM, or install vllm=={SUPPORTED_VLLM}."
        )
