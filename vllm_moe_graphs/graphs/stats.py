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
    capture_seconds: list[float] = dataclasses.field(default_factory=list)  # unpublished
    pool_bytes: int = 0  # the shared graph pool, now
    scratch_bytes: int = 0  # the caller's static buffers and scratch, now

    def replay(self, kind: StepKind = StepKind.DECODE) -> None:
        self.replays += 1
        self.replays_by_kind[kind] = self.replays_by_kind.get(kind, 0) + 1

    def fallback(self, reason: Reason, kind: StepKind = StepKind.DECODE) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        self.fallbacks_by_kind[reason, kind] = self.fallbacks_by_kind.get((reason, kind), 0) + 1

    @property
    def eager_fallbacks(self) -> int:
        return sum(self.fallbacks.values())
