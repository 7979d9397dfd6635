"""Every environment variable of vllm_moe_graphs, in one place.

Each entry is a lazy parser: reading `envs.MOE_GRAPHS_DISABLE` parses the current value and raises
`ValueError` naming the variable, the bad value and the accepted values. `validate_all()` parses
them all; the plugin calls it at start-up so a typo fails fast instead of being ignored.

Names never start with `VLLM_`: vLLM validates that prefix and rejects unknown names.
Nothing else in the package calls `os.getenv`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_TRUE = ("1", "true")
_FALSE = ("0", "false", "")


def _parse_bool(name: str) -> bool:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a valid value; accepted: 1, true, 0, false "
        f"(case-insensitive) or unset. Example: {name}=1"
    )


def _parse_kill_file(name: str) -> str | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    path = os.path.abspath(os.path.expanduser(raw))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(
            f"{name}={raw!r} is not a valid value; accepted: a file path whose directory "
            f"exists (the file itself is created by the operator to switch graphs off). "
            f"Directory {parent!r} does not exist: create it or choose another path."
        )
    if os.path.isdir(path):
        raise ValueError(
            f"{name}={raw!r} is not a valid value; it names a directory, accepted: a file "
            f"path, e.g. {os.path.join(path, 'moe_graphs.kill')!r}"
        )
    return path


# What MOE_GRAPHS_UNPROVEN may name: configurations whose kernels are built but whose GPU parity
# against stock vLLM is not yet proven (capability.PROVING_NAMES, kept here without importing it).
UNPROVEN_NAMES = ("fp8", "fp8_kv")


def _parse_names(name: str, accepted: tuple[str, ...]) -> frozenset[str]:
    raw = os.environ.get(name, "")
    names = frozenset(x.strip() for x in raw.split(",") if x.strip())
    unknown = sorted(names - set(accepted))
    if unknown:
        raise ValueError(
            f"{name}={raw!r} is not a valid value: {unknown} not known; accepted: a comma list "
            f"of {list(accepted)} or unset. Example: {name}={accepted[0]}"
        )
    return names


def _parse_dir(name: str) -> str | None:
    raw = os.environ.get(name)
    return raw or None


# name -> parser. Documented in docs/operating.md and README.md.
environment_variables: dict[str, Callable[[], Any]] = {
    # Full rollback: when true the plugin registers nothing and patches nothing, so vLLM builds the
    # exact engine config it would build without the plugin installed.
    "MOE_GRAPHS_DISABLE": lambda: _parse_bool("MOE_GRAPHS_DISABLE"),
    # Runtime kill switch: while this file exists every decode batch runs eager (captured graphs
    # are kept); remove the file and replay resumes. Checked at most every ~100 ms.
    "MOE_GRAPHS_KILL_FILE": lambda: _parse_kill_file("MOE_GRAPHS_KILL_FILE"),
    # Proof runs only: configurations the capability denies as unproven (block-quantized FP8
    # weights "fp8", an FP8 KV cache "fp8_kv") are taken over anyway, with a warning, so a GPU parity test can
    # prove them. Never for serving: until proven, they may differ from stock vLLM.
    "MOE_GRAPHS_UNPROVEN": lambda: _parse_names("MOE_GRAPHS_UNPROVEN", UNPROVEN_NAMES),
    # Internal: the metrics directory created by the root process (the API server or the process
    # that built the LLM) and inherited by engine and worker processes. Set by the plugin itself;
    # operators leave it alone.
    "MOE_GRAPHS_METRICS_DIR": lambda: _parse_dir("MOE_GRAPHS_METRICS_DIR"),
}


def validate_all() -> dict[str, Any]:
    """Parse every variable; raise `ValueError` on the first invalid one."""
    return {name: parse() for name, parse in environment_variables.items()}


def set_internal(name: str, value: str) -> None:
    """Export an internal variable so that child processes inherit it."""
    assert name == "MOE_GRAPHS_METRICS_DIR", f"{name} is not an internal variable"
    os.environ[name] = value


def get_raw(name: str) -> str | None:
    """The raw string of a variable this package reads but does not own (e.g. Prometheus')."""
    return os.environ.get(name)


# vLLM's own variable, read and set by the decode-graph take-over only (integration/hooks.py):
# "0" makes every vLLM process pick the V1 model runner, also for dense Qwen3.
VLLM_RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"


def select_vllm_v1_runner() -> None:
    """Export VLLM_USE_V2_MODEL_RUNNER=0 for this process and every engine process it starts."""
    os.environ[VLLM_RUNNER_VARIABLE] = "0"


# vLLM's own variable, set by the `moe-graphs` command line only: vLLM logs to stdout by default,
# where its INFO lines would interleave with the command's report.
VLLM_LOGGING_VARIABLE = "VLLM_LOGGING_STREAM"


def send_vllm_logging_to_stderr() -> None:
    """Export VLLM_LOGGING_STREAM=ext://sys.stderr unless the user chose a stream; call before
    vLLM is imported."""
    os.environ.setdefault(VLLM_LOGGING_VARIABLE, "ext://sys.stderr")


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
