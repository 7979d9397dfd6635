"""Prometheus metrics of vllm_moe_graphs (names `moe_graphs_*`).

Metrics are *recorded* in the process that runs the model (the EngineCore / worker processes of
`vllm serve`) and *published* by the API server's own `/metrics`; `metrics_transport` moves them
across processes through Prometheus' multiprocess files. This module owns the metric objects:
fixed names, help strings, and bounded labels (`reason` comes only from `capability.Reason`,
`mode` only from `Mode`, `rank` is the worker's rank in its TP group).

The hot path calls plain methods (`replay()`, `fallback(reason)`) after a step, never inside a
captured region.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram, values

from vllm_moe_graphs import __version__, envs
from vllm_moe_graphs.capability import DecodeGraphCapability, Reason
from vllm_moe_graphs.graphs.kinds import StepKind
from vllm_moe_graphs.ops.sampling_plan import SamplingRefusal

if TYPE_CHECKING:
    from vllm_moe_graphs.graphs.stats import GraphStats

PREFIX = "moe_graphs_"


class Mode(str, enum.Enum):
    """Label of `moe_graphs_info`: what the plugin does in this engine."""

    GRAPHS = "graphs"  # capability proven at config time: the plugin's graphs may replay
    STOCK = "stock"  # plugin loaded, but the capability report denies graphs: stock vLLM runs
    DISABLED = "disabled"  # disabled by configuration


# name -> help; the single list of what we export (docs/operating.md mirrors it).
METRICS: dict[str, str] = {
    "moe_graphs_info": "vllm_moe_graphs version and mode (value 1 for the current mode)",
    "moe_graphs_capability": "1 for each reason in the current capability report "
    "(reason=eligible when the plugin's graphs may replay), 0 otherwise",
    "moe_graphs_replays_total": "engine steps replayed from a CUDA graph, by step kind",
    "moe_graphs_eager_fallbacks_total": "engine steps run eager, by reason and step kind",
    "moe_graphs_captures_total": "CUDA graphs captured, by the kind of the step that captured",
    "moe_graphs_step_captures_total": "CUDA graphs captured inside a serving step, which waited "
    "for the capture (a key's first use: lazy capture), by step kind; the other captures ran at "
    "start-up (precapture) or while the engine waited for requests (idle_capture)",
    "moe_graphs_capture_failures_total": "CUDA graph captures that failed (key quarantined), by "
    "step kind",
    "moe_graphs_capture_seconds": "time to capture one CUDA graph, by step kind",
    "moe_graphs_invalidations_total": "times every captured graph was dropped (KV storage "
    "identity change, unbind, reload), by reason",
    "moe_graphs_pool_bytes": "bytes held by the shared CUDA graph memory pool, by the step kind "
    "whose captures grew it",
    "moe_graphs_graph_rows_total": "rows (decode: requests; other kinds: query tokens) of steps "
    "run at a graph key's padded size, by step kind and row (real or padding)",
    "moe_graphs_scratch_bytes": "bytes of static input/output and scratch buffers used by graphs",
    "moe_graphs_sampled_in_graph_total": "engine steps whose tokens a sampler graph drew "
    "(sample_in_graph), by step kind",
    "moe_graphs_sampler_fallbacks_total": "engine steps whose tokens vLLM's sampler drew while "
    "sample_in_graph is on, by reason (all_greedy: vLLM's argmax by design) and step kind",
    "moe_graphs_sampling_inexact_rows_total": "rows a sampler graph drew from its 129 "
    "candidates while ties of the k-th largest logit reached past them",
}

_CAPTURE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# One multiprocess value class per (process, directory): its files are named by pid, and two
# instances in one process over one directory would map the same file twice.
_value_class_by_key: dict[tuple[int, str], type] = {}


@contextlib.contextmanager
def _file_backed_values(directory: str | None) -> Iterator[None]:
    """Create metrics inside this block so their values live in `directory`'s mmap files.

    If prometheus_client is already in multiprocess mode in this process (vLLM set
    PROMETHEUS_MULTIPROC_DIR before it was imported), its own value class is reused. Otherwise
    our own `MultiProcessValue` class is swapped in for the duration of the block only, so vLLM's
    metrics in this process are left as they were. With no directory, values stay in memory.
    """
    if directory is None or getattr(values.ValueClass, "_multiprocess", False):
        yield
        return
    cls = _value_class_by_key.setdefault((os.getpid(), directory), values.MultiProcessValue())
    saved_cls, saved_dir = values.ValueClass, os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    values.ValueClass = cls
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # read by the value class at creation
    try:
        yield
    finally:
        values.ValueClass = saved_cls
        if saved_dir is None:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved_dir


def metrics_directory() -> str | None:
    """Where this process' metrics must be written: vLLM's multiprocess directory when vLLM
    runs several API servers (it collects that one), else the plugin's own."""
    return envs.get_raw("PROMETHEUS_MULTIPROC_DIR") or envs.MOE_GRAPHS_METRICS_DIR


class MetricsRecorder:
    """The plugin's metrics in one process. Every label child is created up front (labels are
    bounded), so nothing is allocated on the hot path and every series exists from the start."""

    def __init__(self, rank: int = 0, directory: str | None = None) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r} must be an integer >= 0")
        self.rank = rank
        self.directory = directory
        self._published: dict[int, list] = {}  # id(stats) -> [stats, what was published]
        r = str(rank)
        with _file_backed_values(directory):
            # registry=None: these objects are never registered in this process; the root
            # process publishes them from the files (see metrics_transport).
            self._info = Gauge("moe_graphs_info", METRICS["moe_graphs_info"],
                               ["version", "mode"], registry=None, multiprocess_mode="max")
            self._info_children = {m: self._info.labels(__version__, m.value) for m in Mode}
            self._capability = Gauge("moe_graphs_capability", METRICS["moe_graphs_capability"],
                                     ["reason"], registry=None, multiprocess_mode="max")
            self._capability_children = {x: self._capability.labels(x.value) for x in Reason}
            replays = Counter("moe_graphs_replays", METRICS["moe_graphs_replays_total"],
                              ["kind", "rank"], registry=None)
            self._replays = {k: replays.labels(k.value, r) for k in StepKind}
            fallbacks = Counter("moe_graphs_eager_fallbacks",
                                METRICS["moe_graphs_eager_fallbacks_total"],
                                ["reason", "kind", "rank"], registry=None)
            self._fallbacks = {(x, k): fallbacks.labels(x.value, k.value, r)
                               for x in Reason for k in StepKind}
            captures = Counter("moe_graphs_captures", METRICS["moe_graphs_captures_total"],
                               ["kind", "rank"], registry=None)
            self._captures = {k: captures.labels(k.value, r) for k in StepKind}
            step_captures = Counter("moe_graphs_step_captures",
                                    METRICS["moe_graphs_step_captures_total"], ["kind", "rank"],
                                    registry=None)
            self._step_captures = {k: step_captures.labels(k.value, r) for k in StepKind}
            failures = Counter(
                "moe_graphs_capture_failures", METRICS["moe_graphs_capture_failures_total"],
                ["kind", "rank"], registry=None)
            self._capture_failures = {k: failures.labels(k.value, r) for k in StepKind}
            seconds = Histogram(
                "moe_graphs_capture_seconds", METRICS["moe_graphs_capture_seconds"],
                ["kind", "rank"], registry=None, buckets=_CAPTURE_BUCKETS)
            self._capture_seconds = {k: seconds.labels(k.value, r) for k in StepKind}
            rows = Counter("moe_graphs_graph_rows", METRICS["moe_graphs_graph_rows_total"],
                           ["kind", "row", "rank"], registry=None)
            self._real_rows = {k: rows.labels(k.value, "real", r) for k in StepKind}
            self._padding_rows = {k: rows.labels(k.value, "padding", r) for k in StepKind}
            invalidations = Counter("moe_graphs_invalidations",
                                    METRICS["moe_graphs_invalidations_total"], ["reason", "rank"],
                                    registry=None)
            self._invalidations = {x: invalidations.labels(x.value, r) for x in Reason}
            pool = Gauge("moe_graphs_pool_bytes", METRICS["moe_graphs_pool_bytes"],
                         ["kind", "rank"], registry=None, multiprocess_mode="max")
            self._pool_bytes = {k: pool.labels(k.value, r) for k in StepKind}
            self._scratch_bytes = Gauge(
                "moe_graphs_scratch_bytes", METRICS["moe_graphs_scratch_bytes"], ["rank"],
                registry=None, multiprocess_mode="max").labels(r)
            sampled = Counter("moe_graphs_sampled_in_graph",
                              METRICS["moe_graphs_sampled_in_graph_total"], ["kind", "rank"],
                              registry=None)
            self._sampled = {k: sampled.labels(k.value, r) for k in StepKind}
            sampler_fallbacks = Counter(
                "moe_graphs_sampler_fallbacks", METRICS["moe_graphs_sampler_fallbacks_total"],
                ["reason", "kind", "rank"], registry=None)
            self._sampler_fallbacks = {(x, k): sampler_fallbacks.labels(x.value, k.value, r)
                                       for x in SamplingRefusal if x is not SamplingRefusal.SERVABLE
                                       for k in StepKind}
            self._inexact_rows = Counter(
                "moe_graphs_sampling_inexact_rows",
                METRICS["moe_graphs_sampling_inexact_rows_total"], ["rank"],
                registry=None).labels(r)
        # the GraphStats counters `publish` sends, each with its label children by step kind
        self._by_kind = (("replays_by_kind", self._replays), ("captures_by_kind", self._captures),
                         ("sampled_by_kind", self._sampled),
                         ("step_captures_by_kind", self._step_captures),
                         ("capture_failures_by_kind", self._capture_failures),
                         ("real_rows_by_kind", self._real_rows),
                         ("padding_rows_by_kind", self._padding_rows))

    # -- recording ---------------------------------------------------------------------------
    def set_mode(self, mode: Mode) -> None:
        mode = Mode(mode)
        for m, child in self._info_children.items():
            child.set(1 if m is mode else 0)

    def set_capability(self, report: DecodeGraphCapability) -> None:
        current = set(report.reasons)
        for reason, child in self._capability_children.items():
            child.set(1 if reason in current else 0)

    def replay(self, n: int = 1, kind: StepKind = StepKind.DECODE) -> None:
        self._replays[StepKind(kind)].inc(n)

    def fallback(self, reason: Reason, n: int = 1, kind: StepKind = StepKind.DECODE) -> None:
        if not isinstance(reason, Reason):
            raise TypeError(f"reason={reason!r} must be a capability.Reason (bounded labels)")
        self._fallbacks[reason, StepKind(kind)].inc(n)

    def capture(self, seconds: float, kind: StepKind = StepKind.DECODE) -> None:
        self._captures[StepKind(kind)].inc()
        self._capture_seconds[StepKind(kind)].observe(seconds)

    def record_invalidation(self, reason: Reason) -> None:
        """`kv.storage.InvalidationSink`: the KV storage calls this once per invalidation."""
        if not isinstance(reason, Reason):
            raise TypeError(f"reason={reason!r} must be a capability.Reason (bounded labels)")
        self._invalidations[reason].inc()

    def capture_failure(self, kind: StepKind = StepKind.DECODE) -> None:
        self._capture_failures[StepKind(kind)].inc()

    def set_memory(self, pool_bytes_by_kind: Mapping[StepKind, int], scratch_bytes: int) -> None:
        """The graph pool's bytes by step kind (kinds absent: 0) and the scratch bytes."""
        for kind, child in self._pool_bytes.items():
            child.set(pool_bytes_by_kind.get(kind, 0))
        self._scratch_bytes.set(scratch_bytes)

    def publish(self, stats: GraphStats) -> None:
        """Publish what changed in a graph runner's `stats` since the last call (the
        integration layer calls this after each engine step, outside any captured region).
        A new `stats` object (a new runner) starts from zero."""
        last = self._published.get(id(stats))
        if last is None or last[0] is not stats:
            # [stats, published counters by name, pool bytes by kind, scratch bytes]
            last = self._published[id(stats)] = [stats, {}, None, None]
        counts = last[1]
        for name, children in self._by_kind:
            _publish_deltas(getattr(stats, name), counts.setdefault(name, {}),
                            lambda kind, n, c=children: c[kind].inc(n))
        _publish_deltas(stats.fallbacks_by_kind, counts.setdefault("fallbacks", {}),
                        lambda key, n: self.fallback(key[0], n, key[1]))
        _publish_deltas(stats.sampler_fallbacks_by_kind, counts.setdefault("sampler", {}),
                        lambda key, n: self._sampler_fallbacks[key].inc(n))
        _publish_deltas({0: stats.sampling_inexact_rows}, counts.setdefault("inexact", {}),
                        lambda _, n: self._inexact_rows.inc(n))
        while stats.capture_seconds:
            kind, seconds = stats.capture_seconds.pop(0)
            self._capture_seconds[kind].observe(seconds)
        if stats.pool_bytes_by_kind != last[2] or stats.scratch_bytes != last[3]:
            self.set_memory(stats.pool_bytes_by_kind, stats.scratch_bytes)
            last[2], last[3] = dict(stats.pool_bytes_by_kind), stats.scratch_bytes


def _publish_deltas(now: dict, published: dict, inc) -> None:
    """`inc(key, n)` for what each counter of `now` gained since `published`, then remember."""
    if now == published:
        return
    for key, n in now.items():
        if n != published.get(key, 0):
            inc(key, n - published.get(key, 0))
    published.clear()
    published.update(now)


_recorder_by_pid: dict[int, MetricsRecorder] = {}


def process_rank() -> int:
    """This process' torch.distributed rank (0 when not initialised: one worker)."""
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def recorder(rank: int | None = None) -> MetricsRecorder:
    """This process' recorder (created on first use, after any fork, with the right files);
    `rank` None: this process' torch.distributed rank (0 when not initialised)."""
    if rank is None:
        rank = process_rank()
    pid = os.getpid()
    rec = _recorder_by_pid.get(pid)
    if rec is None:
        rec = _recorder_by_pid[pid] = MetricsRecorder(rank, metrics_directory())
    return rec
