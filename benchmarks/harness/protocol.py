"""What the parent (`benchmarks.decode`) and a mode worker (`benchmarks.harness.mode_worker`)
exchange.

The parent writes a `WorkerSpec` JSON file, starts `python -m benchmarks.harness.mode_worker
SPEC`, and reads back a `WorkerResult` JSON file. The worker rewrites its result file after every measured
point, so a worker killed at the time limit still leaves everything it measured behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from benchmarks.harness.sampling import GREEDY

SCHEMA = "vllm_moe_graphs.decode_bench/1"
# Extra decode tokens per request beyond warm-up + timed steps + the steps early requests decode
# while later ones still prefill: covers the async-scheduling lag at both ends of a point.
SLACK_STEPS = 8
# Interleaved runs (`--interleave`): the worker prints READY once its engine is up, then reads
# `point BATCH CONTEXT REP [SAMPLING]` (default greedy) / `quit` lines on stdin and answers each
# with `DONE ok|error ...`.
READY = "[bench-ready]"
DONE = "[bench-done]"


@dataclasses.dataclass(slots=True)
class WorkerSpec:
    """One model x one mode: every (batch, context) point runs inside one engine."""

    model: str  # shape name, e.g. "qwen3-0.6b"
    config_dir: str  # directory holding the config.json that vLLM loads (dummy weights)
    mode: str
    llm_kwargs: dict[str, Any]  # everything passed to vllm.LLM(...)
    env: dict[str, str]  # extra environment for the worker (set before vLLM is imported)
    batches: list[int]
    contexts: list[int]
    repeats: int
    decode_tokens: int  # timed decode steps per request and repeat
    warmup_steps: int  # decode steps discarded at the start of each repeat
    vocab_size: int
    seed: int
    result_path: str
    round: int = 0  # --rounds: which round of engine starts this worker belongs to (0-based)
    interleaved: bool = False  # --interleave: measure what the parent sends on stdin
    # --sampling: every point is measured under each of these presets (harness/sampling.py)
    sampling: list[str] = dataclasses.field(default_factory=lambda: [GREEDY])
    # Absolute `time.time()` limits; None = unlimited.
    hard_deadline: float | None = None  # the whole run's end: no point starts after this
    first_pass_deadline: float | None = None  # repeat 1 starts no point after this ...
    soft_deadline: float | None = None  # ... repeats 2.. none after this

    def points(self) -> list[tuple[int, int]]:
        """(batch, context) pairs, cheapest first, so a cut-short run keeps the cheap ones."""
        pairs = [(b, c) for b in self.batches for c in self.contexts]
        return sorted(pairs, key=lambda p: (p[0] * p[1], p[0]))

    def runs(self) -> list[tuple[int, int, str]]:
        """(batch, context, sampling): `points()`, each under every preset in turn, so that a
        point's presets run back to back."""
        return [(b, c, s) for b, c in self.points() for s in self.sampling]


@dataclasses.dataclass(slots=True)
class PointResult:
    batch: int
    context: int
    sampling: str = GREEDY  # the preset its requests sampled with (harness/sampling.py)
    step_ms: list[float] = dataclasses.field(default_factory=list)  # all repeats, in order
    repeat_p50_ms: list[float] = dataclasses.field(default_factory=list)
    prefill_s: list[float] = dataclasses.field(default_factory=list)  # per repeat, untimed part
    point_s: list[float] = dataclasses.field(default_factory=list)  # per repeat: add to all done
    repeats_done: int = 0
    error: str | None = None


@dataclasses.dataclass(slots=True)
class WorkerResult:
    model: str
    mode: str
    status: str = "starting"  # starting | running | ok | failed
    error: str | None = None
    import_s: float | None = None  # import of vLLM
    startup_s: float | None = None  # vllm.LLM(...) construction until ready
    capture_s: float | None = None  # from vLLM's "Graph capturing finished" log record
    graph_mem_mib: float | None = None  # same record
    compile_s: float | None = None  # compilation_config.compilation_time after start-up
    runner: str | None = None  # model runner class actually used
    resolved: dict[str, Any] = dataclasses.field(default_factory=dict)  # config as vLLM ran it
    bandwidth_gbps: float | None = None  # device-to-device copy, 2 * bytes / time
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    points: list[PointResult] = dataclasses.field(default_factory=list)
    skipped: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    wall_s: float | None = None

    def point(self, batch: int, context: int, sampling: str = GREEDY) -> PointResult:
        for p in self.points:
            if (p.batch, p.context, p.sampling) == (batch, context, sampling):
                return p
        p = PointResult(batch=batch, context=context, sampling=sampling)
        self.points.append(p)
        return p


def merge_rounds(results: list[WorkerResult]) -> list[WorkerResult]:
    """One result per (model, mode), the rounds of `--rounds` pooled: every point's steps and
    per-repeat p50s in round order. Engine facts (status, start-up, capture, runner, config)
    are those of the first round whose engine started: its start-up is the cold one an operator
    sees. Order of first appearance; the inputs are not changed."""
    groups: dict[tuple[str, str], list[WorkerResult]] = {}
    for r in results:
        groups.setdefault((r.model, r.mode), []).append(r)
    merged = []
    for rounds in groups.values():
        base = next((r for r in rounds if r.startup_s is not None), rounds[0])
        out = dataclasses.replace(base, points=[], skipped=[s for r in rounds for s in r.skipped])
        for r in rounds:
            for p in r.points:
                q = out.point(p.batch, p.context, p.sampling)
                q.step_ms += p.step_ms
                q.repeat_p50_ms += p.repeat_p50_ms
                q.prefill_s += p.prefill_s
                q.point_s += p.point_s
                q.repeats_done += p.repeats_done
                q.error = None if q.step_ms else (q.error or p.error)
        merged.append(out)
    return merged


def write_json_atomic(path: str | os.PathLike[str], payload: Any) -> None:
    """Write JSON so that a reader never sees half a file (the worker may be killed any time)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def spec_to_json(spec: WorkerSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def spec_from_json(raw: dict[str, Any]) -> WorkerSpec:
    return WorkerSpec(**raw)


def result_to_json(result: WorkerResult) -> dict[str, Any]:
    return dataclasses.asdict(result)


def result_from_json(raw: dict[str, Any]) -> WorkerResult:
    points = [PointResult(**p) for p in raw.get("points", [])]
    fields = {f.name for f in dataclasses.fields(WorkerResult)} - {"points"}
    return WorkerResult(points=points, **{k: v for k, v in raw.items() if k in fields})
