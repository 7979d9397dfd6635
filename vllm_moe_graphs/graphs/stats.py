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
from vllm_moe_graphs.ops.sampling_plan import SamplingRefusal


def _add(counts: dict, key: object, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


@dataclasses.dataclass(slots=True)
class GraphStats:
    """Totals since the runner was created (see the module docstring). Every counter is kept
    once, by step kind (the metrics' `kind` label); the totals are sums of them."""

    # steps whose output came from a graph (replay, or capture then replay)
    replays_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    # steps run eager, by reason and kind (warm-up steps are not fallbacks)
    fallbacks_by_kind: dict[tuple[Reason, StepKind], int] = dataclasses.field(
        default_factory=dict)
    # by the kind of the step that captured (precapture: decode keys decode, others mixed)
    captures_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    # of those, the captures a serving step waited for (a key's first use: lazy capture), not
    # made at start-up (precapture) or while the engine was idle (idle_capture)
    step_captures_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    capture_failures_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    # (kind, seconds) of each capture not yet published
    capture_seconds: list[tuple[StepKind, float]] = dataclasses.field(default_factory=list)
    # the shared pool's bytes by the kind of the step whose capture grew it
    pool_bytes_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    scratch_bytes: int = 0  # the caller's static buffers and scratch, now
    # rows (decode: requests; other kinds: query tokens) of the steps that ran at a key's
    # padded size, real and padding: the padding's share is the bucket ladder's waste
    real_rows_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    padding_rows_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    # sample_in_graph: steps whose tokens a sampler graph drew, and the steps vLLM's sampler
    # drew instead, by why; rows sampled inexactly (top-k ties past the candidates), a total
    sampled_by_kind: dict[StepKind, int] = dataclasses.field(default_factory=dict)
    sampler_fallbacks_by_kind: dict[tuple[SamplingRefusal, StepKind], int] = dataclasses.field(
        default_factory=dict)
    sampling_inexact_rows: int = 0

    def replay(self, kind: StepKind = StepKind.DECODE) -> None:
        _add(self.replays_by_kind, kind)

    def fallback(self, reason: Reason, kind: StepKind = StepKind.DECODE) -> None:
        _add(self.fallbacks_by_kind, (reason, kind))

    def padded_step(self, kind: StepKind, real: int, padding: int) -> None:
        _add(self.real_rows_by_kind, kind, real)
        _add(self.padding_rows_by_kind, kind, padding)

    def sampled_in_graph(self, kind: StepKind, inexact_rows: int) -> None:
        _add(self.sampled_by_kind, kind)
        self.sampling_inexact_rows = inexact_rows

    def sampler_fallback(self, reason: SamplingRefusal, kind: StepKind) -> None:
        _add(self.sampler_fallbacks_by_kind, (reason, kind))

    def capture(self, kind: StepKind, seconds: float, pool_growth: int,
                on_step: bool = False) -> None:
        """One capture; `on_step`: inside a serving step, which waited for it."""
        _add(self.captures_by_kind, kind)
        if on_step:
            _add(self.step_captures_by_kind, kind)
        self.capture_seconds.append((kind, seconds))
        _add(self.pool_bytes_by_kind, kind, pool_growth)

    def capture_failure(self, kind: StepKind) -> None:
        _add(self.capture_failures_by_kind, kind)

    def pool_dropped(self) -> None:
        self.pool_bytes_by_kind.clear()

    @property
    def replays(self) -> int:
        return sum(self.replays_by_kind.values())

    @property
    def fallbacks(self) -> dict[Reason, int]:
        """Eager steps by reason, every kind together."""
        out: dict[Reason, int] = {}
        for (reason, _), n in self.fallbacks_by_kind.items():
            _add(out, reason, n)
        return out

    @property
    def captures(self) -> int:
        return sum(self.captures_by_kind.values())

    @property
    def step_captures(self) -> int:
        return sum(self.step_captures_by_kind.values())

    @property
    def capture_failures(self) -> int:
        return sum(self.capture_failures_by_kind.values())

    @property
    def pool_bytes(self) -> int:
        """The shared graph pool, now."""
        return sum(self.pool_bytes_by_kind.values())

    @property
    def eager_fallbacks(self) -> int:
        return sum(self.fallbacks_by_kind.values())
