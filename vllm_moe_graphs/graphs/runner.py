"""`DecodeGraphRunner`: lazy capture and replay of decode CUDA graphs, with an eager fallback.

Lifecycle: warmup -> capture -> replay -> invalidate -> close.

    runner = DecodeGraphRunner(forward, config, storage=storage, kill_switch=ks)
    d = runner.decide(num_reqs, max_context, is_pure_decode)   # host only, before padding
    # caller fills the static input buffers: real rows first, then padding up to d.batch_size
    # (slot -1, seq_len 0)
    out, d = runner.run(d)                # [num_reqs, ...]; run(d, forward=f) for this step's
    out, d = runner.step(num_reqs, max_context, is_pure_decode)   # decide + run, in one call
    runner.invalidate(Reason.STORAGE_IDENTITY_CHANGED)   # drops graphs and the pool
    runner.close()                                       # idempotent

The runner owns neither inputs nor model: `forward(batch_size)` runs the model on the caller's
static input buffers (the first `batch_size` rows) and returns the static output tensor. It is
given once (constructor) or with each call (`run`, `precapture`) when the inputs belong to that
step. A key (see `buckets.GraphKey`) runs `warmup_steps` eager steps at its padded size, is then
captured into the one shared memory pool and replayed from then on. Every graph remembers the KV storage
generation it was captured under; replay first asks `storage.check_replay`. Replays, fallbacks,
captures and memory are counted in `runner.stats` (a plain `GraphStats`; the integration layer
publishes it as metrics). No vLLM import.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from vllm_moe_graphs.capability import REMEDY, Reason
from vllm_moe_graphs.config import CaptureFailurePolicy, PluginConfig
from vllm_moe_graphs.graphs.buckets import (
    DecodePlan, GraphKey, all_keys, pick_key, pick_mixed_key,
    shared_context_buckets)
from vllm_moe_graphs.graphs.capture import CapturedGraph, CaptureFn, cuda_capture
from vllm_moe_graphs.graphs.decision import Action, Decision
from vllm_moe_graphs.graphs.kinds import StepKind
from vllm_moe_graphs.graphs.stats import GraphStats

if TYPE_CHECKING:
    from vllm_moe_graphs.killswitch import KillSwitch
    from vllm_moe_graphs.kv.storage import PagedKVStorage

logger = logging.getLogger("vllm.moe_graphs")  # under vLLM's log handler

_MIB = 1 << 20

Forward = Callable[[int], torch.Tensor]  # padded batch size -> static output [B, ...]


@dataclasses.dataclass(frozen=True)
class _Graph:
    graph: CapturedGraph
    generation: int | None  # storage generation at capture; None without a storage


class DecodeGraphRunner:
    """Graphs keyed by `GraphKey`, one shared pool, per-key warm-up and quarantine.

    `decide()` is host-only: a few dict lookups, two bisects over the bucket lists, the kill
    switch's cached flag and the storage's O(1) `check_replay`/`proof()`; it reads no GPU value
    and allocates nothing on the replay path.
    """

    def __init__(
        self,
        forward: Forward | None,
        config: PluginConfig,
        *,
        storage: PagedKVStorage | None = None,
        kill_switch: KillSwitch | None = None,
        capture_fn: CaptureFn | None = None,
        new_pool: Callable[[], object] | None = None,
        before_capture: Callable[[], None] | None = None,
        before_replay: Callable[[], None] | None = None,
        decode_plan: DecodePlan | None = None,
    ) -> None:
        """`decode_plan(batch bucket, context bucket)`: the decode attention launch a key's
        graph holds (`buckets.shared_context_buckets`); decode keys with equal plans share one
        graph. None: one graph per (batch bucket, context bucket)."""
        self._forward = forward
        self.config = config
        self._storage = storage
        self._kill = kill_switch
        self.stats = GraphStats()
        self._before_capture = before_capture
        self._before_replay = before_replay
        if capture_fn is None:
            capture_fn = cuda_capture
            new_pool = new_pool or torch.cuda.graph_pool_handle
            self._no_graphs = None if torch.cuda.is_available() else Reason.NO_CUDA
        else:
            self._no_graphs = None
        self._capture_fn = capture_fn
        self._new_pool = new_pool or object
        self._budget_bytes = config.graph_memory_budget_mib * _MIB
        shared = ({} if decode_plan is None else shared_context_buckets(
            config.decode_batch_buckets, config.context_buckets, decode_plan))
        self._shared_keys = {GraphKey(b, c): GraphKey(b, s) for (b, c), s in shared.items()}
        self._graphs: dict[GraphKey, _Graph] = {}
        self._warm: dict[GraphKey, int] = {}  # eager warm-up steps seen per key
        self._quarantined: dict[GraphKey, str] = {}  # key -> error; for the runner's life
        self._pool: object | None = None
        self._pool_bytes = 0
        self._closed = False
        self._unsubscribe = (storage.on_invalidate(self._on_storage_invalidate)
                             if storage is not None else None)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def keys(self) -> tuple[GraphKey, ...]:
        """Keys with a live graph, sorted."""
        return tuple(sorted(self._graphs))

    @property
    def quarantined(self) -> frozenset[GraphKey]:
        return frozenset(self._quarantined)

    def all_keys(self) -> tuple[GraphKey, ...]:
        """The decode key of every bucket pair of the config (pairs that share a graph give one
        key), largest batch first (what precapture captures)."""
        keys = all_keys(self.config.decode_batch_buckets, self.config.context_buckets)
        return tuple(sorted({self._shared(k) for k in keys}, reverse=True))

    def capturable(self, keys: Iterable[GraphKey]) -> tuple[GraphKey, ...]:
        """`keys`, in order, that have no live graph and whose capture nothing denies now
        (quarantine, the storage, the budget, no CUDA, the kill switch)."""
        if self._kill is not None and self._kill.active():
            return ()
        return tuple(k for k in keys if self._capture_denied(k) is None)

    def describe(self) -> list[str]:
        """What the runner will graph, for the start-up log."""
        c = self.config
        lines = [f"graphs on: decode batch buckets {list(c.decode_batch_buckets)}, context "
                 f"buckets {list(c.context_buckets)} ({len(self.all_keys())} decode keys: bucket "
                 f"pairs with one attention plan share a graph), warm-up {c.warmup_steps} "
                 f"steps, pool budget {c.graph_memory_budget_mib} MiB"]
        if c.mixed_graphs:
            lines.append(f"steps with prefill tokens graphed too (mixed_graphs): token buckets "
                         f"{list(c.token_buckets)}, requests padded to min(token bucket, "
                         f"{min(c.mixed_requests, c.decode_batch_buckets[-1])}), more requests "
                         f"to a power of two up to {c.decode_batch_buckets[-1]}")
        return lines

    def mixed_keys(self) -> tuple[GraphKey, ...]:
        """With `mixed_graphs`, the key of every token bucket for the steps below saturation
        (at most `mixed_requests` requests), largest first (none without)."""
        c = self.config
        if not c.mixed_graphs:
            return ()
        return tuple(pick_mixed_key(t, 1, c.token_buckets, c.decode_batch_buckets[-1],
                                    c.mixed_requests)
                     for t in sorted(c.token_buckets, reverse=True))

    def output(self, key: GraphKey) -> torch.Tensor | None:
        """The static output tensor of `key`'s live graph (None when it has none)."""
        entry = self._graphs.get(key)
        return entry.graph.output if entry is not None else None

    @property
    def pool_bytes(self) -> int:
        return self._pool_bytes

    @property
    def scratch_bytes(self) -> int:
        return self.stats.scratch_bytes

    @property
    def kill_switch(self) -> KillSwitch | None:
        return self._kill

    @property
    def closed(self) -> bool:
        return self._closed

    # -- plan ------------------------------------------------------------------------------------
    def decide(self, num_reqs: int, max_context: int, is_pure_decode: bool, *,
               requests: int | None = None) -> Decision:
        """The per-batch decision (host ints only). `num_reqs` counts the forward's rows: the
        requests of a pure-decode step, the query tokens of any other, whose `requests` (with
        `mixed_graphs`) picks a key of steps with prefill tokens; without it such a step runs
        eager (`mixed_batch`). A replay whose storage proof fails invalidates every graph and
        runs eager with the storage's reason."""
        self._check_open("decide")
        if not is_pure_decode and (requests is None or not self.config.mixed_graphs):
            return Decision(Action.EAGER, None, Reason.MIXED_BATCH, num_reqs)
        if is_pure_decode:
            key = pick_key(num_reqs, max_context, self.config.decode_batch_buckets,
                           self.config.context_buckets)
            if isinstance(key, GraphKey):
                key = self._shared(key)
        else:
            key = pick_mixed_key(num_reqs, requests, self.config.token_buckets,
                                 self.config.decode_batch_buckets[-1], self.config.mixed_requests)
        killed = self._kill is not None and self._kill.active()
        if isinstance(key, Reason):
            return Decision(Action.EAGER, None, Reason.KILL_SWITCH if killed else key, num_reqs)
        if self._no_graphs is not None:  # unpadded: no graph is possible here at all
            return Decision(Action.EAGER, key, self._no_graphs, num_reqs)
        if killed:  # the key's shape, no graph
            return Decision(Action.EAGER, key, Reason.KILL_SWITCH, num_reqs)
        entry = self._graphs.get(key)
        if entry is not None:
            if self._storage is not None:
                proof = self._storage.check_replay(self._storage.owner_id, entry.generation)
                if not proof.holds:
                    self.invalidate(proof.reason, proof.detail)
                    return Decision(Action.EAGER, key, proof.reason, num_reqs)
            return Decision(Action.REPLAY, key, Reason.ELIGIBLE, num_reqs)
        if key in self._quarantined:
            return Decision(Action.EAGER, key, Reason.CAPTURE_FAILED, num_reqs)
        if self._storage is not None and not (proof := self._storage.proof()).holds:
            return Decision(Action.EAGER, key, proof.reason, num_reqs)
        if self._pool_bytes >= self._budget_bytes:
            return Decision(Action.EAGER, key, Reason.MEMORY_BUDGET, num_reqs)
        if self._warm.get(key, 0) < self.config.warmup_steps:
            return Decision(Action.EAGER, key, Reason.ELIGIBLE, num_reqs)  # warm-up
        return Decision(Action.CAPTURE, key, Reason.ELIGIBLE, num_reqs)

    # -- run -------------------------------------------------------------------------------------
    def step(self, num_reqs: int, max_context: int, is_pure_decode: bool,
             forward: Forward | None = None) -> tuple[torch.Tensor, Decision]:
        """`decide()` then `run()`, for a caller whose buffers need no padding by the decision."""
        return self.run(self.decide(num_reqs, max_context, is_pure_decode), forward)

    def run(self, decision: Decision, forward: Forward | None = None,
            kind: StepKind = StepKind.DECODE) -> tuple[torch.Tensor, Decision]:
        """Run one step as `decision` (from `decide()`, which the caller padded its buffers by)
        says, through `forward` (default: the constructor's), counted under `kind`; returns the
        output's first `decision.num_reqs` rows and the decision as run (a failed capture runs
        eager)."""
        self._check_open("run")
        d, num_reqs = decision, decision.num_reqs
        fwd = self._forward_fn(forward)
        if d.action is Action.REPLAY:
            out = self._replay(self._graphs[d.key].graph)
        elif d.action is Action.CAPTURE:
            graph = self._capture(d.key, fwd, kind, on_step=True)
            if graph is None:  # quarantined (policy QUARANTINE): this step runs eager
                d = Decision(Action.EAGER, d.key, Reason.CAPTURE_FAILED, num_reqs)
                out = fwd(num_reqs)
            else:
                out = self._replay(graph)  # capture only records: replay for the output
        elif d.warming_up:
            out = fwd(d.batch_size)
            self._warm[d.key] = self._warm.get(d.key, 0) + 1
        else:
            out = fwd(num_reqs)
        if d.action is not Action.EAGER:
            self.stats.replay(kind)
        elif not d.warming_up:
            self.stats.fallback(d.reason, kind)
        if d.padded:
            self.stats.padded_step(kind, num_reqs, d.batch_size - num_reqs)
        return out[:num_reqs], d  # [num_reqs, ...]: padding rows never leave the runner

    def precapture(self, keys: Iterable[GraphKey] | None = None,
                   prepare: Callable[[GraphKey], None] | None = None,
                   forward: Forward | None = None) -> dict[GraphKey, Reason]:
        """Capture `keys` (default: every bucket pair) at start-up, largest batch first.
        `prepare(key)` fills the static buffers with a padded dummy batch for that key.
        Returns key -> ELIGIBLE (captured or already live) or why it was not captured."""
        self._check_open("precapture")
        fwd = self._forward_fn(forward)
        keys = self.all_keys() if keys is None else tuple(sorted(keys, reverse=True))
        out: dict[GraphKey, Reason] = {}
        for key in keys:
            reason = self._capture_denied(key)
            if reason is None:
                if prepare is not None:
                    prepare(key)
                kind = StepKind.DECODE if key.decode else StepKind.MIXED
                reason = (Reason.ELIGIBLE if self._capture(key, fwd, kind)
                          else Reason.CAPTURE_FAILED)
            out[key] = reason
        return out

    def set_scratch_bytes(self, n: int) -> None:
        """Bytes of the caller's static buffers and scratch (reported as metrics)."""
        if n < 0:
            raise ValueError(f"scratch bytes {n!r} must be >= 0")
        self.stats.scratch_bytes = n

    # -- lifecycle -------------------------------------------------------------------------------
    def invalidate(self, reason: Reason, detail: str = "") -> None:
        """Drop every graph and the pool (the next capture starts a new one); warm-up counts
        restart. Quarantine survives. For KV identity changes, weight reload, sleep."""
        if self._closed:
            return
        if self._graphs:
            logger.info("moe_graphs: dropping %d graphs (%s%s)", len(self._graphs),
                        reason.value, f": {detail}" if detail else "")
        self._drop()

    def close(self) -> None:
        """Drop graphs and the pool, unsubscribe from the storage; idempotent."""
        if self._closed:
            return
        self._drop()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._closed = True

    # -- internals -------------------------------------------------------------------------------
    def _on_storage_invalidate(self, reason: Reason, detail: str) -> None:
        self.invalidate(reason, detail)

    def _forward_fn(self, forward: Forward | None) -> Forward:
        fwd = forward if forward is not None else self._forward
        if fwd is None:
            raise TypeError("DecodeGraphRunner: no forward (pass one to the constructor or call)")
        return fwd

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"DecodeGraphRunner.{what}() after close(): create a new runner")

    def _shared(self, key: GraphKey) -> GraphKey:
        """The decode key whose graph serves `key` (itself unless a smaller context bucket has
        the same attention plan)."""
        return self._shared_keys.get(key, key)

    def _capture_denied(self, key: GraphKey) -> Reason | None:
        if self._no_graphs is not None:
            return self._no_graphs
        if key in self._graphs:
            return Reason.ELIGIBLE
        if key in self._quarantined:
            return Reason.CAPTURE_FAILED
        if self._storage is not None and not (proof := self._storage.proof()).holds:
            return proof.reason
        if self._pool_bytes >= self._budget_bytes:
            return Reason.MEMORY_BUDGET
        return None

    def _replay(self, graph: CapturedGraph) -> torch.Tensor:
        if self._before_replay is not None:
            self._before_replay()  # e.g. the prefetch offloader's sync_prev_onload()
        graph.replay()
        return graph.output

    def _capture(self, key: GraphKey, forward: Forward, kind: StepKind = StepKind.DECODE,
                 on_step: bool = False) -> CapturedGraph | None:
        """Capture `key` (for a step of `kind`, the label its capture is counted under;
        `on_step`: inside a serving step, lazily); None when it failed and was quarantined
        (policy QUARANTINE)."""
        assert key not in self._graphs, f"{key} is already captured"
        if self._pool is None:
            self._pool = self._new_pool()
        generation = self._storage.generation if self._storage is not None else None
        batch = key.batch_bucket
        start = time.perf_counter()
        # a key that ran its warm-up steps eagerly at this size needs no warm-up run inside the
        # capture; one captured without (precapture, warmup_steps 0) gets it
        warm_up = self._warm.get(key, 0) == 0
        try:
            graph = self._capture_fn(lambda: forward(batch), self._pool,
                                     self._before_capture, warm_up=warm_up)
        except Exception as exc:  # noqa: BLE001 - any capture error quarantines the key
            self._quarantined[key] = f"{type(exc).__name__}: {exc}"
            if not self._graphs:
                # the failed capture's hold on the pool is gone and no graph holds it: the next
                # capture starts a new pool (an emptied private pool cannot be reused)
                self._pool = None
            self.stats.capture_failure(kind)
            if self.config.capture_failure_policy is CaptureFailurePolicy.RAISE:
                raise RuntimeError(
                    f"decode graph capture failed for {key} ({type(exc).__name__}: {exc}); "
                    f"the key is quarantined. Remedy: set capture_failure_policy to "
                    f"'quarantine' in --additional-config '{{\"moe_graphs\": {{...}}}}' to keep "
                    f"serving eagerly, or {REMEDY[Reason.CAPTURE_FAILED]}") from exc
            logger.warning("moe_graphs: capture of %s failed, key quarantined (runs eager): %s",
                           key, self._quarantined[key])
            return None
        seconds = time.perf_counter() - start
        self._graphs[key] = _Graph(graph, generation)
        self._pool_bytes += graph.pool_bytes
        self.stats.capture(kind, seconds, graph.pool_bytes, on_step)
        if self._pool_bytes >= self._budget_bytes:
            logger.warning("moe_graphs: graph pool at %.1f MiB reached the budget of %d MiB; "
                           "further captures are denied (%s)", self._pool_bytes / _MIB,
                           self.config.graph_memory_budget_mib, REMEDY[Reason.MEMORY_BUDGET])
        return graph

    def _drop(self) -> None:
        graphs, self._graphs = self._graphs, {}
        for entry in graphs.values():
            entry.graph.release()
        self._warm.clear()
        self._pool = None
        self._pool_bytes = 0
        self.stats.pool_dropped()
