"""Moves metrics recorded in engine/worker processes onto the API server's `/metrics`.

Design (see ../shared/DESIGN.md section 7):
- The *root* process (the one the operator started: `vllm serve`'s API server, or a script that
  builds `vllm.LLM`) creates a fresh directory, exports it as `MOE_GRAPHS_METRICS_DIR` before any
  child starts, and registers one collector on prometheus_client's global `REGISTRY` that reads
  the `moe_graphs_*` series from that directory's multiprocess files.
- Engine and worker processes (children) write their metrics into those files
  (`metrics.MetricsRecorder`). With `--api-server-count > 1` vLLM sets `PROMETHEUS_MULTIPROC_DIR`
  and collects that directory itself; children then write there and the root's collector is
  not on the registry vLLM serves, so nothing is counted twice.
- Counters are summed over processes, gauges take the max per label set (they carry a `rank`
  label where ranks differ), so TP workers and restarts of the API server do not double count.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from vllm_moe_graphs import envs
from vllm_moe_graphs.metrics import PREFIX


def is_root_process() -> bool:
    """True in the process the operator started (not a multiprocessing child)."""
    return multiprocessing.parent_process() is None


class PluginCollector:
    """Collects `moe_graphs_*` families from the multiprocess files in `directory`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._inner = MultiProcessCollector(None, path=directory)

    def collect(self) -> Iterator[Metric]:
        if not os.path.isdir(self.directory):
            return
        for family in self._inner.collect():
            if family.name.startswith(PREFIX):
                yield family


_root_dir_by_pid: dict[int, str] = {}
_published: set[tuple[int, int]] = set()  # (pid, id(registry)) with our collector on it


def setup_root(registry: CollectorRegistry = REGISTRY) -> str:
    """Create this run's metrics directory (once per process), export it for child processes
    and publish it on `registry` (once per registry). Returns the directory."""
    pid = os.getpid()
    directory = _root_dir_by_pid.get(pid)
    if directory is None:
        directory = _root_dir_by_pid[pid] = tempfile.mkdtemp(prefix="moe_graphs_metrics_")
        atexit.register(_cleanup, pid, directory)
    envs.set_internal("MOE_GRAPHS_METRICS_DIR", directory)
    if (pid, id(registry)) not in _published:
        registry.register(PluginCollector(directory))
        _published.add((pid, id(registry)))
    return directory


def _cleanup(pid: int, directory: str) -> None:
    if os.getpid() == pid:  # a forked child must not delete its parent's directory
        shutil.rmtree(directory, ignore_errors=True)


def collect_text(registry: CollectorRegistry = REGISTRY) -> str:
    """The `moe_graphs_*` part of `registry` in Prometheus text format (demo, tests)."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return "\n".join(line for line in text.splitlines()
                     if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith(PREFIX))
