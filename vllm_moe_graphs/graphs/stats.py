"""`GraphStats`: the graph runner's counters, plain ints bumped on the hot path.

The runner never talks to Prometheus: it adds to these fields (no I/O, no lock, no allocation
per step), and the integration layer hands the object to `metrics.MetricsRecorder.publish`
after each engine step, outside any captured region, which turns what changed into the
plugin's series on vLLM's /metrics. Tests and benchmarks read the fields directly.
"""

from __future__ import annotations

import dataclasses

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.graphs.kinds import StepKind


@dataclasses.dataclass(slots=True)
class GraphStats:
    """Totals since the runner was created (see the module docstring)."""

    replays: int = 0  # steps whose output came from a graph (replay, or capture then replay)
    fallbacks: dict[Reason, int] = dataclasses.field(default_factory=dict)  # eager, by reason
    # the same two by step kind (the metrics' `kind` label)
    replays_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    fallbacks_by_kind: dict[tuple[Reason, StepKind], int] = dataclasses.field(
        default_factory=dict)
    captures: int = 0
    capture_failures: int = 0
    # by the kind of the step that captured (precapture: decode)
    captures_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    capture_failures_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    # (kind, seconds) of each capture not yet published
    capture_seconds: list[tuple[StepKind, float]] = dataclasses.field(default_factory=list)
    pool_bytes: int = 0  # the shared graph pool, now
    # the pool's growth by the kind of the step whose capture grew it; sums to pool_bytes
    pool_bytes_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    scratch_bytes: int = 0  # the caller's static buffers and scratch, now
    # rows (decode: requests; other kinds: query tokens) of the steps that ran at a key's
    # padded size, real and padding: the padding's share is the bucket ladder's waste
    real_rows_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    padding_rows_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)

    def replay(self, kind: StepKind = StepKind.DECODE) -> None:
        self.replays += 1
        self.replays_by_kind[kind] = self.replays_by_kind.get(kind, 0) + 1

    def fallback(self, reason: Reason, kind: StepKind = StepKind.DECODE) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        self.fallbacks_by_kind[reason, kind] = self.fallbacks_by_kind.get((reason, kind), 0) + 1

    def padded_step(self, kind: StepKind, real: int, padding: int) -> None:
        self.real_rows_by_kind[kind] = self.real_rows_by_kind.get(kind, 0) + real
        self.padding_rows_by_kind[kind] = self.padding_rows_by_kind.get(kind, 0) + padding

    def capture(self, kind: StepKind, seconds: float, pool_growth: int) -> None:
        self.captures += 1
        self.captures_by_kind[kind] = self.captures_by_kind.get(kind, 0) + 1
        self.capture_seconds.append((kind, seconds))
        self.pool_bytes += pool_growth
        self.pool_bytes_by_kind[kind] = self.pool_bytes_by_kind.get(kind, 0) + pool_growth

    def capture_failure(self, kind: StepKind) -> None:
        self.capture_failures += 1
        self.capture_failures_by_kind[kind] = self.capture_failures_by_kind.get(kind, 0) + 1

    def pool_dropped(self) -> None:
        self.pool_bytes = 0
        self.pool_bytes_by_kind.clear()

    @property
    def eager_fallbacks(self) -> int:
        return sum(self.fallbacks.values())
