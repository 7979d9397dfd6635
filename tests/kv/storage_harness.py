"""What the PagedKVStorage tests share: KV layers shaped as vLLM 0.26's TRITON_ATTN allocates them,
the runner's persistent buffers, a counting invalidation sink and a `Harness` that binds them
for serving (the `h` fixture of conftest.py)."""

from __future__ import annotations

import torch

from vllm_moe_graphs.capability import Proof, Reason
from vllm_moe_graphs.kv import PagedKVStorage, StorageIdentity


NB, HKV, BS, D = 4, 2, 16, 64  # blocks, kv heads, tokens per block, head size


def kv_cache(nb: int = NB, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
             ) -> torch.Tensor:
    """vLLM 0.26 TRITON_ATTN default: logical [NB, Hkv, BS, 2D] over physical [NB, BS, Hkv, 2D]."""
    return torch.zeros(nb, BS, HKV, 2 * D, dtype=dtype, device=device).permute(0, 2, 1, 3)


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def make_layers(n: int = 3) -> dict[str, torch.Tensor]:
    return {name(i): kv_cache() for i in range(n)}


def make_buffers() -> dict[str, torch.Tensor]:
    return {"block_table": torch.zeros(8, 32, dtype=torch.int32),
            "slot_mapping": torch.zeros(8, dtype=torch.int64)}


class CountingSink:
    """A real InvalidationSink: what metrics.MetricsRecorder is to implement."""

    def __init__(self) -> None:
        self.reasons: list[Reason] = []

    def record_invalidation(self, reason: Reason) -> None:
        self.reasons.append(reason)


class Harness:
    def __init__(self) -> None:
        self.sink = CountingSink()
        self.storage = PagedKVStorage(metrics=self.sink)
        self.events: list[tuple[Reason, str]] = []
        self.storage.on_invalidate(lambda reason, detail: self.events.append((reason, detail)))

    def bind_serving(self, layers=None, buffers=None) -> StorageIdentity:
        self.layers = make_layers() if layers is None else layers
        self.buffers = make_buffers() if buffers is None else buffers
        ident = self.storage.bind(self.layers, buffers=self.buffers, phase="serving")
        assert self.storage.check_devices("cpu", torch.device("cpu")).holds
        return ident


def eligible(p: Proof) -> bool:
    return p == Proof("storage", Reason.ELIGIBLE)
