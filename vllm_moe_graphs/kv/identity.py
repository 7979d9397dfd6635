"""The identity of a bound KV cache: what a captured decode graph depends on, as plain values.

`TensorIdentity` (shape, stride, dtype, device, address) per tensor, `LayerIdentity` per
attention layer (its KV tensor in vLLM 0.26 TRITON_ATTN's layout, [NB, Hkv, BS, 2 * D] logical),
`StorageIdentity` for everything `kv.storage.PagedKVStorage` bound, each with a `diff` that
names what changed. No vLLM import.
"""

from __future__ import annotations

import dataclasses
import enum
import re

import torch

_MAX_LISTED = 3  # layers named in a change detail; the rest are counted


class Phase(str, enum.Enum):
    PROFILING = "profiling"  # vLLM's throw-away cache of the memory profile: never eligible
    SERVING = "serving"


@dataclasses.dataclass(frozen=True)
class TensorIdentity:
    """Everything a captured graph depends on for one tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    data_ptr: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorIdentity:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.data_ptr())

    def diff(self, other: TensorIdentity) -> str:
        """'' when equal, else 'field old -> new' for every field that differs."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name} {a:#x} -> {b:#x}" if f.name == "data_ptr"
                           else f"{f.name} {a} -> {b}")
        return ", ".join(out)


@dataclasses.dataclass(frozen=True)
class LayerIdentity:
    """One attention layer's KV tensor: [NB, Hkv, BS, 2 * D] logical."""

    name: str  # vLLM layer name, e.g. "model.layers.7.self_attn.attn"
    index: int
    tensor: TensorIdentity
    num_blocks: int
    num_kv_heads: int
    block_size: int  # the kernel block size (tokens per page of this tensor)
    head_size: int


@dataclasses.dataclass(frozen=True)
class StorageIdentity:
    """Snapshot of what is bound; hashable. `layers` is ordered by layer index."""

    owner_id: int
    generation: int
    phase: Phase
    device: torch.device
    layers: tuple[LayerIdentity, ...]
    buffers: tuple[tuple[str, TensorIdentity], ...]  # sorted by name

    @property
    def layer_indices(self) -> dict[str, int]:
        return {layer.name: layer.index for layer in self.layers}

    def diff(self, other: StorageIdentity) -> str:
        """'' when the memory identity (owner, layers, buffers) is equal, else what changed."""
        out: list[str] = []
        if self.owner_id != other.owner_id:
            out.append(f"owner {self.owner_id} -> {other.owner_id}")
        mine, theirs = self.layer_indices, other.layer_indices
        if mine != theirs:
            moved = sorted(n for n in mine.keys() & theirs.keys() if mine[n] != theirs[n])
            out.append(f"layer set changed: removed {sorted(mine.keys() - theirs.keys())}, "
                       f"added {sorted(theirs.keys() - mine.keys())}"
                       + (f", reindexed {moved}" if moved else ""))
        else:
            changed = [f"layer {a.name!r} (index {a.index}): {d}"
                       for a, b in zip(self.layers, other.layers) if (d := a.tensor.diff(b.tensor))]
            out += changed[:_MAX_LISTED]
            if len(changed) > _MAX_LISTED:
                out.append(f"... and {len(changed) - _MAX_LISTED} more layers")
        mine_b, theirs_b = dict(self.buffers), dict(other.buffers)
        if set(mine_b) != set(theirs_b):
            out.append(f"buffer set changed: {sorted(mine_b)} -> {sorted(theirs_b)}")
        else:
            for name, t in mine_b.items():
                if d := t.diff(theirs_b[name]):
                    out.append(f"buffer {name!r}: {d}")
        return "; ".join(out)


_ONE_INT = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index_from_name(name: str) -> int:
    """The single integer component of a dotted layer name ('model.layers.7.self_attn.attn')."""
    found = _ONE_INT.findall(name)
    if len(found) != 1:
        raise ValueError(f"layer name {name!r} must contain exactly one integer component to "
                         "give its layer index; pass layer_indices explicitly")
    return int(found[0])


def layer_identity(name: str, index: int, t: torch.Tensor, head_size: int | None
                    ) -> LayerIdentity:
    tid = TensorIdentity.of(t)
    if t.dim() != 4 or t.shape[3] % 2:
        raise ValueError(f"layer {name!r}: expected a [num_blocks, num_kv_heads, block_size, "
                         f"2 * head_size] KV tensor (vLLM 0.26 TRITON_ATTN), got {tid.shape}")
    if head_size is not None and t.shape[3] != 2 * head_size:
        raise ValueError(f"layer {name!r}: last dim {t.shape[3]} != 2 * head_size "
                         f"({2 * head_size})")
    if t.stride(3) != 1:
        raise ValueError(f"layer {name!r}: the head dim needs unit stride, strides {tid.stride}")
    nb, hkv, bs, two_d = tid.shape
    return LayerIdentity(name, index, tid, nb, hkv, bs, two_d // 2)
