"""`PagedKVStorage`: the one owner of the KV cache identity that decode graphs bake in.

A captured CUDA graph holds raw addresses of the per-layer KV tensors and of the persistent
block-table / slot-mapping buffers it read. vLLM reallocates them behind our back (memory
profiling builds and frees a throw-away cache, sleep/wake, weight reload, a second engine in the
same process), and a replay over a freed address reads freed or foreign memory. This object owns
that identity and proves it before every capture and replay.

Lifecycle (the runner drives it; one runner thread, no locking):

    storage = PagedKVStorage(metrics=recorder)         # owner_id chosen here
    storage.bind(kv_caches, phase="profiling")         # throw-away cache: never eligible
    storage.unbind()                                   # before vLLM frees it
    storage.bind(kv_caches, buffers=..., phase="serving")
    storage.check_devices(runner_device, model_device)
    storage.proof()                                    # Proof("storage", ELIGIBLE)
    gen = storage.generation                           # stored with each captured graph
    storage.check_replay(owner_id, gen)                # cheap gate before every replay
    storage.revalidate(kv_caches)                      # after wake-up and weight reload
    storage.close()                                    # idempotent; bind after close raises

Any identity change (pointer, shape, stride, dtype, device, owner, layer or buffer set) moves the
storage to "invalidated": listeners and the metrics sink hear about it once, the generation bumps,
and `proof()` denies until a fresh `bind`.

Per-layer tensors use vLLM 0.26 TRITON_ATTN's layout: logical [NB, Hkv, BS, 2 * D] (K and V
packed on the last dim), any stride order as long as D has unit stride. No vLLM import here.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from vllm_moe_graphs.capability import Proof, Reason
from vllm_moe_graphs.kv.identity import (
    Phase,
    StorageIdentity,
    TensorIdentity,
    layer_identity,
    layer_index_from_name,
)

PROOF_NAME = "storage"
DEVICE_PROOF_NAME = "device"

InvalidationListener = Callable[[Reason, str], None]


class InvalidationSink(Protocol):
    """What the metrics recorder implements to count storage invalidations.

    `record_invalidation` is called once per invalidation, after the storage state changed and
    before listeners run, never inside a captured region. `reason` is
    `Reason.STORAGE_IDENTITY_CHANGED` (a detected change: pointer, shape, stride, dtype, device,
    owner, layer/buffer set) or `Reason.STORAGE_UNBOUND` (an explicit `unbind()`/`close()` of a
    bound storage, e.g. the profiling teardown).
    """

    def record_invalidation(self, reason: Reason) -> None: ...


class _State(enum.Enum):
    UNBOUND = "unbound"
    BOUND = "bound"
    INVALIDATED = "invalidated"
    CLOSED = "closed"


class PagedKVStorage:
    """Owner of the KV cache identity; see the module docstring for the lifecycle.

    While bound it holds strong references to the bound tensors, so their memory cannot be freed
    and reused at the same address behind a captured graph.
    # NOTE: the runner must `unbind()` before vLLM frees the profiling cache, or that memory
    # stays allocated until the next bind.
    """

    def __init__(self, metrics: InvalidationSink | None = None) -> None:
        self._owner_id = uuid.uuid4().int >> 64  # one owner per engine; never reused
        self._metrics = metrics
        self._listeners: list[InvalidationListener] = []
        self._state = _State.UNBOUND
        self._generation = 0
        self._identity: StorageIdentity | None = None
        self._layers: dict[str, torch.Tensor] = {}  # held while bound
        self._buffers: dict[str, torch.Tensor] = {}
        self._device_proof: tuple[int, Proof] | None = None  # (generation, proof)
        self._detail = "never bound"

    # -- queries ---------------------------------------------------------------------------------
    @property
    def owner_id(self) -> int:
        return self._owner_id

    @property
    def generation(self) -> int:
        """Bumps on every bind, unbind, invalidation and close; never decreases."""
        return self._generation

    @property
    def bound(self) -> bool:
        return self._state is _State.BOUND

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def identity(self) -> StorageIdentity:
        if self._identity is None or self._state is not _State.BOUND:
            raise RuntimeError(f"PagedKVStorage is not bound ({self._detail})")
        return self._identity

    def kv_cache(self, layer_name: str) -> torch.Tensor:
        """The owned [NB, Hkv, BS, 2 * D] tensor of one layer."""
        self.identity()
        if layer_name not in self._layers:
            raise KeyError(f"layer {layer_name!r} is not bound")
        return self._layers[layer_name]

    def buffer(self, name: str) -> torch.Tensor:
        """A persistent buffer registered at bind (block table, slot mapping, ...)."""
        self.identity()
        if name not in self._buffers:
            raise KeyError(f"buffer {name!r} is not bound (bound: {sorted(self._buffers)})")
        return self._buffers[name]

    def proof(self) -> Proof:
        """Proof("storage", ELIGIBLE) only when bound in the serving phase, with a single owner
        (a foreign owner id seen by `verify_owner` invalidates) and the device proof of this
        generation holding."""
        if self._state is _State.INVALIDATED:
            return Proof(PROOF_NAME, Reason.STORAGE_IDENTITY_CHANGED, self._detail)
        if self._state is not _State.BOUND:
            return Proof(PROOF_NAME, Reason.STORAGE_UNBOUND, self._detail)
        if self._identity.phase is not Phase.SERVING:
            return Proof(PROOF_NAME, Reason.STORAGE_UNBOUND,
                         "bound in the profiling phase (throw-away cache)")
        if self._device_proof is None or self._device_proof[0] != self._generation:
            return Proof(PROOF_NAME, Reason.DEVICE_MISMATCH,
                         f"devices not checked for generation {self._generation}: call "
                         "check_devices(runner_device, model_device) after bind")
        device = self._device_proof[1]
        if not device.holds:
            return Proof(PROOF_NAME, device.reason, device.detail)
        return Proof(PROOF_NAME, Reason.ELIGIBLE)

    # -- owner and replay gate ---------------------------------------------------------------------
    def verify_owner(self, owner_id: int) -> Proof:
        """ELIGIBLE when `owner_id` is this storage's owner. A foreign owner invalidates a bound
        storage (a runner or backend holds someone else's instance) and denies."""
        if owner_id == self._owner_id:
            return Proof(PROOF_NAME, Reason.ELIGIBLE)
        detail = f"owner mismatch: storage owner {self._owner_id}, presented {owner_id}"
        if self._state is _State.BOUND:
            self._invalidate(Reason.STORAGE_IDENTITY_CHANGED, detail)
        return Proof(PROOF_NAME, Reason.STORAGE_IDENTITY_CHANGED, detail)

    def check_replay(self, owner_id: int, generation: int) -> Proof:
        """The per-replay gate: owner, generation the graph was captured under, then `proof()`.
        Host-only and O(1): no tensor is touched."""
        owner = self.verify_owner(owner_id)
        if not owner.holds:
            return owner
        if generation != self._generation:
            return Proof(PROOF_NAME, Reason.STORAGE_IDENTITY_CHANGED,
                         f"graph captured under generation {generation}, storage is at "
                         f"{self._generation}")
        return self.proof()

    def check_devices(self, runner_device: torch.device | str,
                      model_device: torch.device | str) -> Proof:
        """Proof("device"): KV tensors, buffers, runner and model are on one device. The result
        is kept for the current generation and feeds `proof()`. Pass concrete devices: an
        index-less "cuda" is not proven equal to "cuda:0" (deny, not guess)."""
        self._check_open("check_devices")
        if self._state is not _State.BOUND:
            return Proof(DEVICE_PROOF_NAME, Reason.STORAGE_UNBOUND, self._detail)
        devices = {"kv_cache": self._identity.device, "runner": torch.device(runner_device),
                   "model": torch.device(model_device)}
        if len(set(devices.values())) == 1:
            proof = Proof(DEVICE_PROOF_NAME, Reason.ELIGIBLE)
        else:
            proof = Proof(DEVICE_PROOF_NAME, Reason.DEVICE_MISMATCH,
                          ", ".join(f"{k}={v}" for k, v in devices.items()))
        self._device_proof = (self._generation, proof)
        return proof

    # -- lifecycle ---------------------------------------------------------------------------------
    def on_invalidate(self, callback: InvalidationListener) -> Callable[[], None]:
        """Call `callback(reason, detail)` once per invalidation; returns a remover."""
        self._listeners.append(callback)

        def remove() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return remove

    def bind(self, layers: Mapping[str, torch.Tensor], *, phase: Phase | str,
             buffers: Mapping[str, torch.Tensor] | None = None,
             layer_indices: Mapping[str, int] | None = None,
             head_size: int | None = None) -> StorageIdentity:
        """Take ownership of `layers` (vLLM layer name -> KV tensor) and the persistent
        `buffers` (name -> block table / slot mapping / ...). Indices come from `layer_indices`
        or the single integer in each layer name. Bumps the generation. A bind over a bound
        storage with a different identity notifies listeners first (STORAGE_IDENTITY_CHANGED);
        every bind needs a fresh `check_devices`. Raises ValueError on a malformed binding
        (nothing changes then) and RuntimeError after close()."""
        self._check_open("bind")
        new = self._snapshot(layers, buffers or {}, Phase(phase), layer_indices, head_size)
        if self._state is _State.BOUND and (d := self._identity.diff(new)):
            self._invalidate(Reason.STORAGE_IDENTITY_CHANGED, f"rebind: {d}")
        self._generation += 1
        self._identity = dataclasses.replace(new, generation=self._generation)
        self._layers, self._buffers = dict(layers), dict(buffers or {})
        self._state = _State.BOUND
        self._device_proof = None
        self._detail = ""
        return self._identity

    def unbind(self, detail: str = "unbind") -> None:
        """Release the bound tensors (call before vLLM frees them). Listeners hear
        STORAGE_UNBOUND if the storage was bound. No-op when unbound or closed."""
        if self._state is _State.BOUND:
            self._invalidate(Reason.STORAGE_UNBOUND, detail, _State.UNBOUND)
        elif self._state is _State.INVALIDATED:
            self._generation += 1
            self._state, self._detail = _State.UNBOUND, detail

    def revalidate(self, layers: Mapping[str, torch.Tensor],
                   buffers: Mapping[str, torch.Tensor] | None = None) -> Proof:
        """Compare the tensors vLLM holds now with the bound identity (after wake-up, after
        weight reload, before capture). Unchanged: returns `proof()`, generation kept. Changed:
        invalidates (metrics, listeners) and denies with what changed. `buffers=None` skips the
        buffer comparison. O(layers) host work: for lifecycle events, not the replay path."""
        self._check_open("revalidate")
        if self._state is not _State.BOUND:
            return self.proof()
        cur = self._identity
        known = cur.layer_indices  # unknown names get distinct negative indices: a set change
        indices = {n: known.get(n, -1 - i) for i, n in enumerate(layers)}
        try:
            new = self._snapshot(layers, buffers or {}, cur.phase, indices, None)
            change = cur.diff(new if buffers is not None
                              else dataclasses.replace(new, buffers=cur.buffers))
        except ValueError as exc:
            change = str(exc)
        if change:
            self._invalidate(Reason.STORAGE_IDENTITY_CHANGED, change)
        return self.proof()

    def invalidate(self, detail: str) -> None:
        """Invalidate a bound storage from outside (e.g. a failed write proof)."""
        if self._state is _State.BOUND:
            self._invalidate(Reason.STORAGE_IDENTITY_CHANGED, detail)

    def close(self) -> None:
        """Unbind and drop listeners; idempotent. Any later bind/revalidate raises."""
        if self._state is _State.CLOSED:
            return
        self.unbind("closed")
        self._listeners.clear()
        self._state, self._detail = _State.CLOSED, "closed"

    # -- internals ---------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._state is _State.CLOSED:
            raise RuntimeError(f"PagedKVStorage.{what}() after close(): create a new storage")

    def _snapshot(self, layers: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                  phase: Phase, layer_indices: Mapping[str, int] | None,
                  head_size: int | None) -> StorageIdentity:
        if not layers:
            raise ValueError("bind needs at least one attention layer")
        if layer_indices is not None:
            if set(layer_indices) != set(layers):
                raise ValueError(f"layer_indices names {sorted(layer_indices)} != layer names "
                                 f"{sorted(layers)}")
        else:
            layer_indices = {n: layer_index_from_name(n) for n in layers}
        if len(set(layer_indices.values())) != len(layer_indices):
            raise ValueError(f"duplicate layer indices in {dict(layer_indices)}")
        out = sorted((layer_identity(n, layer_indices[n], t, head_size)
                      for n, t in layers.items()), key=lambda x: (x.index, x.name))
        bufs = tuple(sorted((k, TensorIdentity.of(v)) for k, v in buffers.items()))
        devices = {x.tensor.device for x in out} | {t.device for _, t in bufs}
        if len(devices) != 1:
            raise ValueError(f"KV tensors and buffers must share one device, got "
                             f"{sorted(map(str, devices))}")
        return StorageIdentity(self._owner_id, self._generation, phase, devices.pop(),
                               tuple(out), bufs)

    def _invalidate(self, reason: Reason, detail: str,
                    state: _State = _State.INVALIDATED) -> None:
        self._state, self._detail = state, detail
        self._identity, self._layers, self._buffers, self._device_proof = None, {}, {}, None
        self._generation += 1
        if self._metrics is not None:
            self._metrics.record_invalidation(reason)
        for callback in list(self._listeners):
            callback(reason, detail)
