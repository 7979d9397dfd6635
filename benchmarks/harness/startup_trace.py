"""Where an engine start-up's time goes: `cProfile` around `vllm.LLM(...)` and every Triton
kernel compiled meanwhile, with its seconds.

Used by the mode worker when `BENCH_STARTUP_PROFILE_DIR` is set (`benchmarks/gpu/run.sh` sets it
with `BENCH_STARTUP_PROFILE=1`); the report goes to
`<dir>/startup-<model>-<mode>[-r<round>].txt`. The benchmark's worker runs vLLM's engine in its own
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the profile sees the whole start: config, model
inspection, model load, profile run, KV cache, capture or warm-up. cProfile slows Python down;
read the shares, and time start-ups without it (`benchmarks.startup`).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

TOP_FUNCTIONS = 60


@dataclass
class CompileLog:
    """Triton compiles seen through `knobs.runtime.jit_cache_hook` (before a compile) and
    `jit_post_compile_hook` (after): kernel name and seconds, in order."""

    compiles: list[tuple[str, float]] = field(default_factory=list)
    _started: dict[int, list[tuple[str, float]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def before(self, name: str) -> None:
        with self._lock:
            self._started.setdefault(threading.get_ident(), []).append((name, time.perf_counter()))

    def after(self, name: str) -> None:
        now = time.perf_counter()
        with self._lock:
            stack = self._started.get(threading.get_ident()) or []
            start = stack.pop()[1] if stack else now
            self.compiles.append((name, now - start))

    def report(self) -> list[str]:
        total = sum(s for _, s in self.compiles)
        lines = [f"## Triton compiles: {len(self.compiles)}, {total:.2f} s in all "
                 "(a disk-cache hit counts too, at its load time)"]
        by_name: dict[str, list[float]] = {}
        for name, s in self.compiles:
            by_name.setdefault(name, []).append(s)
        for name, secs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"{sum(secs):8.2f} s  {len(secs):3d}x  {name}")
        lines.append("## in order")
        lines += [f"{s:8.3f} s  {name}" for name, s in self.compiles]
        return lines


@contextmanager
def _triton_hooks(log: CompileLog) -> Iterator[None]:
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001 - no Triton: nothing to hook
        yield
        return
    prev_pre, prev_post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

    def name_of(kwargs: dict[str, Any]) -> str:
        return str(getattr(kwargs.get("fn"), "name", "<unknown>"))

    def pre(**kwargs: Any) -> Any:
        log.before(name_of(kwargs))
        return prev_pre(**kwargs) if prev_pre is not None else False

    def post(**kwargs: Any) -> Any:
        log.after(name_of(kwargs))
        return prev_post(**kwargs) if prev_post is not None else None

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = pre, post
    try:
        yield
    finally:
        # vLLM installs its JIT monitor's hook when the engine is ready; keep it, chained to
        # what was there before us.
        if knobs.runtime.jit_cache_hook is pre:
            knobs.runtime.jit_cache_hook = prev_pre
        if knobs.runtime.jit_post_compile_hook is post:
            knobs.runtime.jit_post_compile_hook = prev_post


@contextmanager
def trace_startup(path: str, title: str) -> Iterator[CompileLog]:
    """Profile the block (the engine's start) and write the report to `path`."""
    log = CompileLog()
    prof = cProfile.Profile()
    start = time.perf_counter()
    with _triton_hooks(log):
        prof.enable()
        try:
            yield log
        finally:
            prof.disable()
            wall = time.perf_counter() - start
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats("cumulative").print_stats(TOP_FUNCTIONS)
            out.write("\n")
            stats.sort_stats("tottime").print_stats(TOP_FUNCTIONS // 2)
            lines = [f"# start-up trace: {title}: {wall:.2f} s under cProfile", *log.report(),
                     "## cProfile (cumulative, then own time)", out.getvalue()]
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")


def maybe_trace_startup(spec: Any) -> Any:
    """`trace_startup` into `$BENCH_STARTUP_PROFILE_DIR` when that is set, else a no-op."""
    out_dir = os.environ.get("BENCH_STARTUP_PROFILE_DIR")
    if not out_dir:
        return nullcontext()
    stem = f"{spec.model}-{spec.mode}" + (f"-r{spec.round}" if spec.round else "")
    return trace_startup(os.path.join(out_dir, f"startup-{stem}.txt"), stem)
