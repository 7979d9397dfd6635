"""Warm-up proofs over a bound `PagedKVStorage`: the per-layer KV write proof.

The write proof shows that the backend's write path, given what the backend would hand it for
layer L, writes into the tensor the storage owns for L and into no other layer's. For each layer
a sentinel pattern unique to (layer, pass) goes through `write` into one reserved slot; the
reserved slot of every owned tensor must then hold exactly its own layer's sentinel. Two passes
run, layers in ascending then descending order, so a write that also lands in a later layer's
slot (overwritten by that layer's own write in one order) is caught in the other order.

All checks stay on the device: per-layer booleans accumulate in one [2, layers] tensor and are
read back once at the end. The reserved slots are restored bit for bit afterwards (also when the
proof fails or the writer raises).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from vllm_moe_graphs.capability import Proof, Reason
from vllm_moe_graphs.kv.storage import PagedKVStorage
from vllm_moe_graphs.ops.kv_write import split_kv_cache

PROOF_NAME = "kv_write"
# vLLM's BlockPool hands block 0 out as the null block, never to a request: its slots are free
# to scribble on at warm-up (and are restored anyway).
RESERVED_SLOT = 0

# write(key [T, Hkv, D], value [T, Hkv, D], key_cache [NB, BS, Hkv, D],
#       value_cache [NB, BS, Hkv, D], slot_mapping [T] int64): `ops.write_kv`'s signature.
WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def sentinel(code: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """[1, Hkv, D] pattern unique to `code` (0 <= code < 40000). Small integers only, exact in
    fp16 / bf16 / fp32, so a writer that converts values still writes the same bits."""
    assert 0 <= code < 40_000 and head_size >= 2, f"sentinel code {code} out of range"
    flat = (torch.arange(num_kv_heads * head_size, device=device) * 37 % 97 - 48).float()
    flat[0] = code % 200 + 1  # the code, in base 200, where the filler never reaches
    flat[1] = code // 200 + 1 + 60
    return flat.view(1, num_kv_heads, head_size).to(dtype)


def prove_kv_writes(storage: PagedKVStorage, write: WriteKV, *,
                    caches: Mapping[str, torch.Tensor] | None = None,
                    slot: int = RESERVED_SLOT) -> Proof:
    """Proof("kv_write"): writes through `write` land in the owned tensor of that exact layer.

    `caches` maps each bound layer name to the KV tensor the backend would pass to its write
    path for that layer (e.g. vLLM's `layer.kv_cache`); by default the storage's own tensors,
    which then tests `write` alone. Denies with STORAGE_UNBOUND when the storage is not bound
    and STORAGE_IDENTITY_CHANGED naming the failing layers. Raises ValueError for a slot outside
    some layer's cache or a `caches` mapping with other layer names; exceptions of `write`
    propagate (after the slots are restored). Warm-up only: not graph safe (one host read).
    """
    if not storage.bound:
        return Proof(PROOF_NAME, Reason.STORAGE_UNBOUND, "storage is not bound")
    ident = storage.identity()
    layers = ident.layers
    names = [layer.name for layer in layers]
    if caches is None:
        caches = {name: storage.kv_cache(name) for name in names}
    if set(caches) != set(names):
        raise ValueError(f"caches name layers {sorted(caches)}, storage binds {sorted(names)}")
    for layer in layers:
        if not 0 <= slot < layer.num_blocks * layer.block_size:
            raise ValueError(f"slot {slot} is outside layer {layer.name!r} "
                             f"({layer.num_blocks} blocks of {layer.block_size})")

    owned = [split_kv_cache(storage.kv_cache(x.name), x.head_size) for x in layers]
    given = [split_kv_cache(caches[x.name], x.head_size) for x in layers]
    where = [divmod(slot, x.block_size) for x in layers]  # (block, offset) per layer
    slots = [(k[b, o], v[b, o]) for (k, v), (b, o) in zip(owned, where)]  # [Hkv, D] views
    saved = [(_bits(k).clone(), _bits(v).clone()) for k, v in slots]
    slot_mapping = torch.full((1,), slot, dtype=torch.int64, device=ident.device)  # [T=1]
    n = len(layers)
    ok = torch.ones(2, n, dtype=torch.bool, device=ident.device)  # [pass, layer]
    try:
        for p, order in enumerate((range(n), range(n - 1, -1, -1))):
            pats = [tuple(sentinel(4 * i + 2 * p + kv, x.num_kv_heads, x.head_size,
                                   x.tensor.dtype, ident.device) for kv in (0, 1))
                    for i, x in enumerate(layers)]
            for i in order:
                write(pats[i][0], pats[i][1], given[i][0], given[i][1], slot_mapping)
            for i, (k, v) in enumerate(slots):
                ok[p, i] = ((_bits(k) == _bits(pats[i][0][0])).all()
                            & (_bits(v) == _bits(pats[i][1][0])).all())
        passed = ok.all(dim=0).tolist()  # NOTE: the proof's single host read
    finally:
        for (k, v), (sk, sv) in zip(slots, saved):
            _bits(k).copy_(sk)
            _bits(v).copy_(sv)

    failed = [name for name, good in zip(names, passed) if not good]
    if not failed:
        return Proof(PROOF_NAME, Reason.ELIGIBLE)
    shown = ", ".join(repr(x) for x in failed[:8]) + (", ..." if len(failed) > 8 else "")
    return Proof(PROOF_NAME, Reason.STORAGE_IDENTITY_CHANGED,
                 f"{len(failed)}/{n} layers: a write through the backend path did not land "
                 f"only in the layer's owned KV tensor (slot {slot}): {shown}")
