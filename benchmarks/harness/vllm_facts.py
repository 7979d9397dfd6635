"""What the benchmark reads from vLLM 0.26 itself: its log records, its resolved config, and
whether it accepts our kwargs. Every vLLM name used here was checked against the 0.26.0 sources.
"""

from __future__ import annotations

import enum
import logging
import os
import re
from typing import Any

from benchmarks.harness.protocol import WorkerSpec

CAPTURE_MSG = "Graph capturing finished in %.0f secs, took %.2f GiB"  # vLLM 0.26, V1 and V2
CAPTURE_RE = re.compile(r"Graph capturing finished in (\S+) secs, took (\S+) GiB")
INIT_MSG_PREFIX = "init engine (profile, create kv cache, warmup model) took"


class VllmLogTap(logging.Handler):
    """Reads vLLM's own start-up records: graph capture time and memory, engine init time.

    The numbers come from the record's args (full precision); the printed message rounds the
    capture time to whole seconds."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.capture_s: float | None = None
        self.graph_mem_gib: float | None = None
        self.captures = 0
        self.init_engine_s: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.msg if isinstance(record.msg, str) else ""
            if msg.startswith("Graph capturing finished"):
                secs, gib = _capture_numbers(record)
                self.capture_s = (self.capture_s or 0.0) + secs
                self.graph_mem_gib = (self.graph_mem_gib or 0.0) + gib
                self.captures += 1
            elif msg.startswith(INIT_MSG_PREFIX) and record.args:
                self.init_engine_s = float(record.args[0])  # type: ignore[index]
        except Exception:  # noqa: BLE001 - a log tap must never break the engine
            pass


def _capture_numbers(record: logging.LogRecord) -> tuple[float, float]:
    args = record.args
    if isinstance(args, tuple) and len(args) == 2:
        return float(args[0]), float(args[1])
    match = CAPTURE_RE.search(record.getMessage())
    if match is None:
        raise ValueError(f"unexpected capture log line: {record.getMessage()!r}")
    return float(match.group(1)), float(match.group(2))


def check_config_dicts(llm_kwargs: dict[str, Any]) -> None:
    """Every key of the nested config dicts must be an init field of vLLM's config class."""
    from vllm.config.attention import AttentionConfig
    from vllm.config.compilation import CompilationConfig
    from vllm.config.utils import is_init_field

    for key, cls in (
        ("compilation_config", CompilationConfig),
        ("attention_config", AttentionConfig),
    ):
        for field in llm_kwargs.get(key) or {}:
            try:
                ok = is_init_field(cls, field)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{key}.{field} is not a settable field of vLLM {cls.__name__}")


def validate(spec: WorkerSpec) -> dict[str, Any]:
    """CPU check: vLLM 0.26 accepts every kwarg and every config key of this mode."""
    os.environ.update(spec.env)
    from vllm.engine.arg_utils import EngineArgs

    check_config_dicts(spec.llm_kwargs)
    args = EngineArgs(**spec.llm_kwargs)
    cc, ac = args.compilation_config, args.attention_config
    return {
        "mode": spec.mode,
        "enforce_eager": args.enforce_eager,
        "compilation_mode": getattr(cc.mode, "name", str(cc.mode)),
        "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
        "attention_backend": getattr(ac.backend, "name", str(ac.backend)),
        "load_format": args.load_format,
        "enable_prefix_caching": args.enable_prefix_caching,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
    }


def _get(obj: Any, path: str) -> Any:
    """`obj.a.b.c`, None where a link is missing; enum members become their names."""
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj.name if isinstance(obj, enum.Enum) else obj


def describe_engine(llm: Any) -> tuple[dict[str, Any], str | None, float | None]:
    """The configuration vLLM actually runs with, after its own resolution at start-up."""
    engine = llm.llm_engine
    vc = engine.vllm_config
    resolved = {
        "compilation_mode": _get(vc, "compilation_config.mode"),
        "cudagraph_mode": _get(vc, "compilation_config.cudagraph_mode"),
        "cudagraph_capture_sizes": list(vc.compilation_config.cudagraph_capture_sizes or []),
        "attention_backend": _get(vc, "attention_config.backend"),
        "enforce_eager": _get(vc, "model_config.enforce_eager"),
        "max_model_len": _get(vc, "model_config.max_model_len"),
        "num_hidden_layers": _get(vc, "model_config.hf_config.num_hidden_layers"),
        "max_num_seqs": _get(vc, "scheduler_config.max_num_seqs"),
        "max_num_batched_tokens": _get(vc, "scheduler_config.max_num_batched_tokens"),
        "async_scheduling": _get(vc, "scheduler_config.async_scheduling"),
        "num_gpu_blocks": _get(vc, "cache_config.num_gpu_blocks"),
        "block_size": _get(vc, "cache_config.block_size"),
        "enable_prefix_caching": _get(vc, "cache_config.enable_prefix_caching"),
        "use_v2_model_runner": getattr(vc, "use_v2_model_runner", None),
        "worker_cls": _get(vc, "parallel_config.worker_cls"),
    }
    runner_obj = _get(engine, "model_executor.driver_worker.worker.model_runner")  # in-process
    runner = (
        None
        if runner_obj is None
        else f"{type(runner_obj).__module__}.{type(runner_obj).__qualname__}"
    )
    resolved["attention_backends_used"] = _backends_used(runner_obj)
    compile_s = getattr(vc.compilation_config, "compilation_time", None)
    return resolved, runner, (float(compile_s) if compile_s else None)


def _backends_used(runner: Any) -> list[str] | None:
    """Names of the attention backends the runner built (V1 and V2 runners: `attn_groups`)."""
    try:
        return sorted({g.backend.get_name() for groups in runner.attn_groups for g in groups})
    except Exception:  # noqa: BLE001 - descriptive only
        return None
