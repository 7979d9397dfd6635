"""`GraphStats`: the graph runner's counters, plain ints bumped on the hot path.

The runner never talks to Prometheus: it adds to these fields (no I/O, no lock, no allocation
per step), and the integration layer hands the object to `metrics.MetricsRecorder.publish`
after each engine step, outside any captured region, which turns what changed into the
plugin's series on vLLM's /metrics. Tests and benchmarks read the fields directly.
"""

from __future__ import annotations

import dataclasses

from vllm_moe_graphs.capability import Reason


@dataclasses.dataclass(slots=True)
class GraphStats:
    """Totals since the runner was created (see the module docstring)."""

    replays: int = 0  # steps whose output came from a graph (replay, or capture then replay)
    fallbacks: dict[Reason, int] = dataclasses.field(default_factory=dict)  # eager, by reason
    captures: int = 0
    capture_failures: int = 0
    capture_seconds: list[float] = dataclasses.field(default_factory=list)  # unpublished
    pool_bytes: int = 0  # the shared graph pool, now
    scratch_bytes: int = 0  # the caller's static buffers and scratch, now

    def fallback(self, reason: Reason) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    @property
    def eager_fallbacks(self) -> int:
        return sum(self.fallbacks.values())
