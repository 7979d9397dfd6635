"""One real `vllm serve` for `benchmarks.serving`: the modes it can run in, its start and stop, what
its log says it resolved (attention backend, CUDA-graph mode, compilation mode), and the engine
step counts its `/metrics` shows.

Stock modes run with `VLLM_PLUGINS=` (empty): no general plugin loads, ours included, exactly as
vLLM runs without the plugin installed. The plugin mode is plain `vllm serve` with the plugin
installed: nothing is passed to turn it on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from vllm_moe_graphs.config import TOKEN_BUCKETS, PluginConfig


@dataclasses.dataclass(frozen=True, slots=True)
class ServeMode:
    name: str
    description: str
    args: tuple[str, ...] = ()  # server flags of this mode only
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ready_estimate_s: float = 100.0  # start to /health on the H200, for the time budget only
    default: bool = True  # runs without --modes; False: only when named
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # its `moe_graphs`

    @property
    def plugin(self) -> bool:
        """Whether the plugin loads in this mode (stock modes set VLLM_PLUGINS=)."""
        return "VLLM_PLUGINS" not in self.env


# What the plugin logs once `idle_capture` has captured every key: a server with it settles
# there after ready (the benchmark waits for it, `settle_s`; about 30 s on the H200 by estimate,
# for the time budget only).
IDLE_CAPTURE_DONE = "moe_graphs: idle capture done"
IDLE_CAPTURE_ON = "or while the engine waits for requests (idle_capture)"  # its start-up line
IDLE_CAPTURE_ESTIMATE_S = 30.0


def plugin_settings(mode: ServeMode, common: Mapping[str, Any]) -> dict[str, Any] | None:
    """The `moe_graphs` settings a mode's server runs with: `common` (--plugin-config) under
    the mode's own; None for a stock mode."""
    return {**common, **mode.settings} if mode.plugin else None


def settings_args(settings: Mapping[str, Any] | None) -> list[str]:
    """`vllm serve` flags setting these `moe_graphs` options (none for none)."""
    return ["--additional-config", json.dumps({"moe_graphs": dict(settings)})] if settings \
        else []


# `plugin_fine_tokens`' token buckets: the defaults (vllm_moe_graphs.config.TOKEN_BUCKETS) with
# sixteen an octave from 2048 tokens instead of eight (128, then 256 tokens apart): fewer padded
# tokens in the GPU-bound steps of long prompts, for 16 more keys to capture.
FINE_TOKEN_BUCKETS: tuple[int, ...] = tuple(sorted(
    set(TOKEN_BUCKETS) | {base * k // 16 for base in (2048, 4096) for k in range(16, 32)}))
# `plugin_eager_long_steps`' token buckets: the defaults up to 4096 tokens. A step of more (a
# long prompt's chunk, GPU-bound) runs eager at its exact size (`step_too_large`): no padded
# tokens, and the eager host work costs nothing where each layer's GPU work outlasts it.
EAGER_PAST_TOKENS = 4096
SHORT_TOKEN_BUCKETS: tuple[int, ...] = tuple(b for b in TOKEN_BUCKETS if b <= EAGER_PAST_TOKENS)

SERVE_MODES: dict[str, ServeMode] = {
    m.name: m
    for m in (
        ServeMode("plugin", "plain `vllm serve` with vllm_moe_graphs installed: the plugin "
                  "replays every step from its graphs (decode, prefill and mixed; steps with "
                  "prefill tokens attend through FlashAttention 3, prefill_attention auto), "
                  "captured while the server waits for requests (idle_capture; the benchmark "
                  "lets it finish after ready: settle_s)", ready_estimate_s=60.0),
        ServeMode("stock", "stock vLLM as an H200 user runs it (VLLM_PLUGINS=): its default "
                  "attention backend (FLASH_ATTN, FlashAttention 3), FULL_AND_PIECEWISE graphs, "
                  "torch.compile", env={"VLLM_PLUGINS": ""}),
        ServeMode("stock_triton", "stock vLLM with --attention-backend TRITON_ATTN "
                  "(VLLM_PLUGINS=)", args=("--attention-backend", "TRITON_ATTN"),
                  env={"VLLM_PLUGINS": ""}),
        ServeMode("plugin_decode_only", "on request: `plugin` with mixed_graphs false (only "
                  "pure-decode steps graphed, steps with prefill tokens eager)",
                  settings=dict(mixed_graphs=False), ready_estimate_s=60.0, default=False),
        ServeMode("plugin_precapture", "on request: `plugin` with precapture (every graph "
                  "captured before the server is ready, none while serving)",
                  settings=dict(precapture=True), ready_estimate_s=70.0, default=False),
        ServeMode("plugin_moe_padding", "on request: `plugin` with skip_moe_padding false "
                  "(the padding rows of a padded step routed through the MoE experts, as stock "
                  "vLLM does)", settings=dict(skip_moe_padding=False), ready_estimate_s=60.0,
                  default=False),
        ServeMode("plugin_fused_router", "on request: `plugin` with fuse_moe_padding_mask "
                  "(the padding rows' expert ids written by the plugin's routing kernel, no "
                  "mask launch per MoE layer)", settings=dict(fuse_moe_padding_mask=True),
                  ready_estimate_s=60.0, default=False),
        ServeMode("plugin_compiled_numerics", "on request: `plugin` with compiled_numerics "
                  "(RMSNorm and SiLU-and-mul rounded as stock's compiled model, by the plugin's "
                  "Triton kernels)", settings=dict(compiled_numerics=True),
                  ready_estimate_s=60.0, default=False),
        ServeMode("plugin_sample_in_graph", "on request: `plugin` with sample_in_graph (a "
                  "sampled batch's tokens drawn by the plugin's sampler graph, not vLLM's eager "
                  "sampler)", settings=dict(sample_in_graph=True), ready_estimate_s=60.0,
                  default=False),
        ServeMode("plugin_lazy_capture", "on request: `plugin` with idle_capture false (graphs "
                  "captured only when traffic first reaches their key, never while idle)",
                  settings=dict(idle_capture=False), ready_estimate_s=60.0, default=False),
        ServeMode("plugin_fine_tokens", "on request: `plugin` with sixteen token buckets an "
                  "octave from 2048 tokens instead of eight (less padding in the GPU-bound steps "
                  "of long prompts, more keys to capture)",
                  settings=dict(token_buckets=list(FINE_TOKEN_BUCKETS)), ready_estimate_s=60.0,
                  default=False),
        ServeMode("plugin_eager_long_steps", "on request: `plugin` with token buckets up to "
                  f"{EAGER_PAST_TOKENS} tokens: a step of more (long prompts' chunks, GPU-bound) "
                  "runs eager at its exact size, no padded tokens (step_too_large)",
                  settings=dict(token_buckets=list(SHORT_TOKEN_BUCKETS)),
                  ready_estimate_s=60.0, default=False),
        ServeMode("plugin_wide_mixed_keys", "on request: `plugin` with mixed_requests at the "
                  "largest decode batch bucket (every step with prefill tokens pads to one key "
                  "of its token bucket, idle capture takes them all, no lazy capture of wider "
                  "keys at saturation)",
                  settings=dict(mixed_requests=PluginConfig().decode_batch_buckets[-1]),
                  ready_estimate_s=60.0, default=False),
        ServeMode("plugin_triton_prefill", "on request: `plugin` with prefill_attention triton "
                  "(steps with prefill tokens attend through the plugin's kernel)",
                  settings=dict(prefill_attention="triton"),
                  ready_estimate_s=60.0, default=False),
    )
}
DEFAULT_MODES = [name for name, mode in SERVE_MODES.items() if mode.default]


# Extra start-up of a server with UVA expert offload: loading the weights into pinned host
# memory alone took 77 s for Qwen3-30B-A3B with 29 GB offloaded on the H200.
OFFLOAD_READY_EXTRA_S = 150.0


def parse_modes(names: Sequence[str]) -> list[ServeMode]:
    unknown = [n for n in names if n not in SERVE_MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(SERVE_MODES)}")
    return [SERVE_MODES[n] for n in dict.fromkeys(names)]


# What vLLM 0.26.0 logs once it has resolved its configuration (first match wins).
_LOG_FACTS = {
    "attention_backend": (re.compile(r"Using (\w+) attention backend out of potential"),
                          re.compile(r"Using AttentionBackendEnum\.(\w+) backend")),
    "cudagraph_mode": (re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(\w+)"),),
    "compilation_mode": (re.compile(r"'mode': <CompilationMode\.(\w+)"),),
    "plugin": (re.compile(r"(moe_graphs [\d.]+: registered)"),),
    "kv_cache_tokens": (re.compile(r"GPU KV cache size: ([\d,]+) tokens"),),
    "graph_pool_set_aside_mib": (
        re.compile(r"moe_graphs: (\d+) MiB of the KV cache memory set aside"),),
}
_INT_FACTS = ("kv_cache_tokens", "graph_pool_set_aside_mib")


def log_facts(log_text: str) -> dict[str, str | int | None]:
    """The resolved attention backend, CUDA-graph mode and compilation mode in a server log,
    whether our plugin registered, the KV cache's size in tokens and the MiB the plugin set
    aside from it for its graph pool (None for what the log does not say)."""
    out: dict[str, str | int | None] = {}
    for key, patterns in _LOG_FACTS.items():
        found = next((m.group(1) for p in patterns if (m := p.search(log_text))), None)
        out[key] = int(found.replace(",", "")) if found and key in _INT_FACTS else found
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


class Server:
    """`python -m vllm.entrypoints.cli.main serve MODEL ...` in its own process group."""

    def __init__(self, model_dir: Path, args: Sequence[str], env: Mapping[str, str],
                 log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                        str(model_dir), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = log_path
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GRAPHS_")}
        full_env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        full_env.update(env)
        self._env = full_env
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self, timeout_s: float) -> float:
        """Start and wait for /health; returns seconds to ready. Raises RuntimeError with the
        log's tail when the server exits or is not ready in time."""
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                      env=self._env, start_new_session=True)
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self._proc.returncode} before "
                                   f"ready; log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                http_get(self.base_url + "/health", timeout=2)
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"vllm serve not ready after {timeout_s:.0f} s; log "
                                   f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def wait_for_log(self, text: str, timeout_s: float,
                     stall_s: float | None = None) -> float | None:
        """Seconds until `text` appears in the log, None when it has not within `timeout_s`
        or, with `stall_s`, once the plugin's capture count on /metrics has not changed for
        that long (captures that stopped will not log `text`). Raises RuntimeError when the
        server exits meanwhile."""
        t0 = changed = time.monotonic()
        captures = None
        while text not in self.log_text():
            if not self.alive():
                raise RuntimeError(f"vllm serve exited while waiting for {text!r}; log "
                                   f"{self.log_path}:\n{self.log_tail()}")
            now = time.monotonic()
            if stall_s is not None and (count := self.scrape().get("captures")) != captures:
                captures, changed = count, now
            if now - t0 > timeout_s or (stall_s is not None and now - changed > stall_s):
                return None
            time.sleep(0.5)
        return time.monotonic() - t0

    def stop(self) -> None:
        """SIGINT to the group, SIGKILL after 30 s; returns once every process of the group
        (the engine core holding the GPU memory included) is gone. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process_group(proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def scrape(self) -> dict[str, float]:
        """The step counters of /metrics (see `step_counters`); empty when unreachable."""
        try:
            return step_counters(http_get(self.base_url + "/metrics"))
        except OSError:
            return {}


def stop_process_group(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGINT to `proc`'s process group (started with start_new_session=True), SIGKILL after
    `grace_s`; returns once every process of the group is gone, so the next server finds the
    memory, cores and ports this one held free."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    while _group_alive(proc) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(proc):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        while _group_alive(proc) and time.monotonic() < deadline + 10:
            time.sleep(0.2)


def _group_alive(proc: subprocess.Popen[Any]) -> bool:
    """Is any process of `proc`'s process group still running (zombies reaped)?"""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return proc.returncode is None or _group_has_others(proc.pid)


def _group_has_others(pgid: int) -> bool:
    """After the leader exited: does /proc list another process of group `pgid`?"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def step_counters(metrics_text: str) -> dict[str, float]:
    """Flat counters from a /metrics text: `replays`, `replays:<step kind>`, `captures`,
    `captures:<kind>`, `step_captures` (those a serving step waited for), `capture_s:<kind>`
    (seconds), `rows:<kind>:<real|padding>` (rows of
    steps run at a key's padded size), `pool_bytes:<kind>` (a gauge), `fallback:<reason>` (the
    plugin's, summed over ranks), and vLLM's `engine_steps` (the iteration-tokens histogram's
    count) and `preemptions`."""
    out: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "moe_graphs_replays_total":
                add("replays", s.value)
                if "kind" in s.labels:
                    add("replays:" + s.labels["kind"], s.value)
            elif s.name == "moe_graphs_captures_total":
                add("captures", s.value)
                if "kind" in s.labels:
                    add("captures:" + s.labels["kind"], s.value)
            elif s.name == "moe_graphs_step_captures_total":
                add("step_captures", s.value)
            elif s.name == "moe_graphs_capture_seconds_sum" and "kind" in s.labels:
                add("capture_s:" + s.labels["kind"], s.value)
            elif s.name == "moe_graphs_graph_rows_total":
                add(f"rows:{s.labels.get('kind', '?')}:{s.labels.get('row', '?')}", s.value)
            elif s.name == "moe_graphs_pool_bytes" and "kind" in s.labels:
                add("pool_bytes:" + s.labels["kind"], s.value)
            elif s.name == "moe_graphs_eager_fallbacks_total":
                add("fallback:" + s.labels.get("reason", "?"), s.value)
            elif s.name == "vllm:iteration_tokens_total_count":
                add("engine_steps", s.value)
            elif s.name == "vllm:num_preemptions_total":
                add("preemptions", s.value)
    return out


def step_shares(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """What a window's engine steps did: counter differences, and for the plugin the share of
    its counted steps replayed from a graph and run eager by reason (warm-up steps before a
    lazy capture are not counted by the plugin), its captures and their seconds by step kind
    (`step_captures`: those a step waited for, i.e. not made while the engine was idle),
    the padding's share of the rows its padded steps ran by kind (the bucket ladder's waste),
    and the graph pool's bytes by kind at the window's end."""
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    out: dict[str, Any] = {
        "engine_steps": int(diff.get("engine_steps", 0)),
        "preemptions": int(diff.get("preemptions", 0)),
    }
    if not any(k == "replays" or k.startswith("fallback:") for k in after):
        return out  # no plugin series: stock vLLM
    fallbacks = {k.split(":", 1)[1]: int(v) for k, v in sorted(diff.items())
                 if k.startswith("fallback:") and v > 0}
    replays = int(diff.get("replays", 0))
    counted = replays + sum(fallbacks.values())
    def by_kind(prefix: str, source: Mapping[str, float]) -> dict[str, float]:
        return {k.split(":", 1)[1]: v for k, v in sorted(source.items())
                if k.startswith(prefix + ":") and v > 0}

    padding_share = {}
    for kind_row in by_kind("rows", diff):
        kind = kind_row.rsplit(":", 1)[0]
        padding = diff.get(f"rows:{kind}:padding", 0.0)
        padding_share[kind] = round(padding / (padding + diff.get(f"rows:{kind}:real", 0.0)), 4)
    out.update(
        replays=replays,
        replays_by_kind={k: int(v) for k, v in by_kind("replays", diff).items()},
        captures=int(diff.get("captures", 0)),
        captures_by_kind={k: int(v) for k, v in by_kind("captures", diff).items()},
        step_captures=int(diff.get("step_captures", 0)),
        capture_s_by_kind={k: round(v, 3) for k, v in by_kind("capture_s", diff).items()},
        padding_share=padding_share,
        pool_mib_by_kind={k: round(v / 2**20, 1) for k, v in by_kind("pool_bytes", after).items()},
        eager=fallbacks,
        replayed_share=round(replays / counted, 4) if counted else None,
        eager_share={k: round(v / counted, 4) for k, v in fallbacks.items()} if counted else {},
    )
    return out
