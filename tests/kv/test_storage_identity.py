"""PagedKVStorage: every identity change of a bound storage invalidates it once (tensors, shapes,
strides, dtypes, devices, buffers, layer indices), owner and generation gate replay, device
mismatches deny."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_graphs.capability import Proof, Reason
from vllm_moe_graphs.kv import PagedKVStorage
from tests.kv.storage_harness import BS, D, HKV, NB, eligible, kv_cache, make_layers, name


def _same_storage_views() -> tuple[torch.Tensor, torch.Tensor]:
    """Two views with the same data_ptr and logical shape but different strides (NHD vs HND)."""
    base = torch.zeros(NB * BS * HKV * 2 * D, dtype=torch.bfloat16)
    nhd = base.view(NB, BS, HKV, 2 * D).permute(0, 2, 1, 3)
    hnd = base.view(NB, HKV, BS, 2 * D)
    return nhd, hnd


def _change(kind: str, layers: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]):
    """Returns (layers, buffers, words the detail must contain, words it must not)."""
    layers, buffers = dict(layers), dict(buffers)
    t = layers[name(1)]
    if kind == "pointer":
        layers[name(1)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        return layers, buffers, [name(1), "data_ptr"], ["shape", "stride", "dtype", "device"]
    if kind == "shape":
        layers[name(1)] = t[: NB - 1]  # same address, one block less
        return layers, buffers, [name(1), "shape (4,"], ["data_ptr", "dtype"]
    if kind == "stride":
        return layers, buffers, [name(1), "stride"], ["data_ptr", "shape"]  # set by the test
    if kind == "dtype":
        layers[name(1)] = t.view(torch.float16)  # same bytes, other dtype
        return layers, buffers, [name(1), "dtype torch.bfloat16 -> torch.float16"], [
            "data_ptr", "shape", "stride"]
    if kind == "device":
        layers = {n: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                  for n, x in layers.items()}
        buffers = {n: x.to("meta") for n, x in buffers.items()}
        return layers, buffers, [name(0), "device cpu -> meta"], ["shape", "dtype"]
    if kind == "layer_removed":
        del layers[name(2)]
        return layers, buffers, ["layer set changed", name(2)], []
    if kind == "layer_added":
        layers[name(3)] = kv_cache()
        return layers, buffers, ["layer set changed", name(3)], []
    if kind == "layer_renamed":
        layers["model.layers.1.self_attn.attn2"] = layers.pop(name(1))
        return layers, buffers, ["layer set changed", "attn2"], []
    if kind == "buffer_pointer":
        buffers["block_table"] = buffers["block_table"].clone()
        return layers, buffers, ["buffer 'block_table'", "data_ptr"], ["shape"]
    if kind == "buffer_shape":
        buffers["slot_mapping"] = buffers["slot_mapping"][:4]
        return layers, buffers, ["buffer 'slot_mapping'", "shape (8,) -> (4,)"], ["data_ptr"]
    if kind == "buffer_set":
        buffers["seq_lens"] = torch.zeros(8, dtype=torch.int32)
        return layers, buffers, ["buffer set changed", "seq_lens"], []
    if kind == "malformed":
        layers[name(1)] = t[:, :, :, :D].reshape(-1)
        return layers, buffers, [name(1), "expected a"], []
    raise AssertionError(kind)


CHANGES = ["pointer", "shape", "stride", "dtype", "device", "layer_removed", "layer_added",
           "layer_renamed", "buffer_pointer", "buffer_shape", "buffer_set", "malformed"]


@pytest.mark.parametrize("kind", CHANGES)
def test_every_identity_change_invalidates_once(h, kind):
    s = h.storage
    layers = make_layers()
    if kind == "stride":
        layers[name(1)], hnd = _same_storage_views()
    h.bind_serving(layers=layers)
    assert eligible(s.proof())
    gen = s.generation
    new_layers, new_buffers, must, must_not = _change(kind, h.layers, h.buffers)
    if kind == "stride":
        new_layers[name(1)] = hnd
        assert hnd.data_ptr() == layers[name(1)].data_ptr() and hnd.shape == layers[name(1)].shape

    p = s.revalidate(new_layers, new_buffers)

    assert p.reason is Reason.STORAGE_IDENTITY_CHANGED and p.name == "storage"
    assert len(h.events) == 1, h.events
    reason, detail = h.events[0]
    assert reason is Reason.STORAGE_IDENTITY_CHANGED and detail == p.detail
    for word in must:
        assert word in detail, (word, detail)
    for word in must_not:
        assert word not in detail, (word, detail)
    assert h.sink.reasons == [Reason.STORAGE_IDENTITY_CHANGED]
    assert not s.bound and s.generation > gen
    with pytest.raises(RuntimeError):
        s.identity()
    # stays invalid until a fresh bind, and says so only once
    assert s.revalidate(h.layers, h.buffers).reason is Reason.STORAGE_IDENTITY_CHANGED
    assert s.proof().reason is Reason.STORAGE_IDENTITY_CHANGED
    assert len(h.events) == 1 and len(h.sink.reasons) == 1
    h.bind_serving()
    assert eligible(s.proof()) and len(h.events) == 1


def test_change_detail_is_bounded_and_reindexing_is_a_change(h):
    s = h.storage
    h.bind_serving(layers=make_layers(5))
    s.revalidate({n: t.clone() for n, t in h.layers.items()}, h.buffers)
    detail = h.events[-1][1]
    assert detail.count("data_ptr") == 3 and detail.endswith("... and 2 more layers")
    layers = make_layers(2)
    s.bind(layers, phase="serving")
    s.bind(layers, phase="serving", layer_indices={name(0): 1, name(1): 0})
    reason, detail = h.events[-1]
    assert reason is Reason.STORAGE_IDENTITY_CHANGED and "reindexed" in detail
    assert len(h.events) == 2


def test_revalidate_without_buffers_ignores_them(h):
    s = h.storage
    h.bind_serving()
    assert eligible(s.revalidate(h.layers))
    assert s.identity().buffers and h.events == []


def test_owner_mismatch_invalidates_and_denies(h):
    s = h.storage
    other = PagedKVStorage()
    assert other.owner_id != s.owner_id
    h.bind_serving()
    assert s.verify_owner(s.owner_id) == Proof("storage", Reason.ELIGIBLE)
    p = s.verify_owner(other.owner_id)
    assert p.reason is Reason.STORAGE_IDENTITY_CHANGED and "owner mismatch" in p.detail
    assert str(other.owner_id) in p.detail
    assert not s.bound and s.proof().reason is Reason.STORAGE_IDENTITY_CHANGED
    assert [r for r, _ in h.events] == [Reason.STORAGE_IDENTITY_CHANGED]
    assert h.sink.reasons == [Reason.STORAGE_IDENTITY_CHANGED]
    # unbound: still denied, no second notification
    assert not s.verify_owner(other.owner_id).holds and len(h.events) == 1


def test_check_replay_gates_on_owner_and_generation(h):
    s = h.storage
    h.bind_serving()
    captured = s.generation
    assert eligible(s.check_replay(s.owner_id, captured))
    stale = s.check_replay(s.owner_id, captured - 1)
    assert stale.reason is Reason.STORAGE_IDENTITY_CHANGED and "generation" in stale.detail
    assert s.bound and h.events == []  # a stale graph does not invalidate the storage
    s.bind(h.layers, buffers=h.buffers, phase="serving")  # same tensors, new generation
    s.check_devices("cpu", "cpu")
    assert not s.check_replay(s.owner_id, captured).holds
    assert eligible(s.check_replay(s.owner_id, s.generation))
    assert not s.check_replay(PagedKVStorage().owner_id, s.generation).holds
    assert not s.bound


def test_device_mismatch(h):
    s = h.storage
    s.bind(make_layers(), phase="serving")
    p = s.check_devices("cpu", "meta")
    assert p.name == "device" and p.reason is Reason.DEVICE_MISMATCH
    assert "model=meta" in p.detail and "kv_cache=cpu" in p.detail
    assert s.proof().reason is Reason.DEVICE_MISMATCH and "model=meta" in s.proof().detail
    assert s.check_devices("meta", "cpu").reason is Reason.DEVICE_MISMATCH
    # a cuda runner without an index is not proven equal to anything
    assert s.check_devices("cuda", "cpu").reason is Reason.DEVICE_MISMATCH
    assert s.check_devices("cpu", "cpu").holds and eligible(s.proof())
    # meta tensors are a device of their own
    meta = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for n, t in make_layers().items()}
    s.bind(meta, phase="serving")
    assert s.identity().device == torch.device("meta")
    assert s.check_devices("cpu", "cpu").reason is Reason.DEVICE_MISMATCH
    assert s.check_devices("meta", "meta").holds
