"""PagedKVStorage: bind / unbind / rebind, generations, malformed bindings, listeners, close."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from vllm_moe_graphs.capability import Proof, Reason
from vllm_moe_graphs.kv import PagedKVStorage, Phase, layer_index_from_name
from tests.kv.storage_harness import (BS, D, HKV, NB, eligible, kv_cache, make_buffers,
                                      make_layers, name)

# ---------------------------------------------------------------------------- bind / unbind


def test_fresh_storage_is_unbound(h):
    s = h.storage
    assert not s.bound and s.generation == 0
    assert s.proof().reason is Reason.STORAGE_UNBOUND
    with pytest.raises(RuntimeError, match="not bound"):
        s.identity()
    assert s.revalidate(make_layers()).reason is Reason.STORAGE_UNBOUND
    assert s.check_devices("cpu", "cpu").reason is Reason.STORAGE_UNBOUND
    s.unbind()  # no-op
    assert s.generation == 0 and h.events == []


def test_bind_serving_records_identity_and_proves_eligible(h):
    s = h.storage
    ident = s.bind(make_layers(3), buffers=make_buffers(), phase="serving")
    assert s.bound and s.generation == 1 == ident.generation
    assert ident.owner_id == s.owner_id and ident.phase is Phase.SERVING
    assert ident.device == torch.device("cpu")
    assert [x.name for x in ident.layers] == [name(0), name(1), name(2)]
    assert ident.layer_indices == {name(i): i for i in range(3)}
    layer = ident.layers[1]
    assert (layer.num_blocks, layer.num_kv_heads, layer.block_size, layer.head_size) == (
        NB, HKV, BS, D)
    t = s.kv_cache(name(1))
    assert layer.tensor.shape == (NB, HKV, BS, 2 * D)
    assert layer.tensor.stride == t.stride() == (BS * HKV * 2 * D, 2 * D, HKV * 2 * D, 1)
    assert layer.tensor.data_ptr == t.data_ptr() and layer.tensor.dtype is torch.bfloat16
    assert dict(ident.buffers)["slot_mapping"].shape == (8,)
    assert s.buffer("block_table").dtype is torch.int32
    with pytest.raises(KeyError):
        s.kv_cache("model.layers.9.self_attn.attn")
    # hashable snapshot, equal while nothing changes
    assert hash(ident) == hash(s.identity()) and ident == s.identity()
    assert {ident: 1}[s.identity()] == 1
    # the device proof is what is still missing
    p = s.proof()
    assert p.reason is Reason.DEVICE_MISMATCH and "check_devices" in p.detail
    assert s.check_devices("cpu", "cpu") == Proof("device", Reason.ELIGIBLE)
    assert eligible(s.proof())
    assert h.events == [] and h.sink.reasons == []


def test_profiling_bind_never_proves_eligible_and_unbind_notifies(h):
    s = h.storage
    layers = make_layers()
    s.bind(layers, phase="profiling")
    assert s.check_devices("cpu", "cpu").holds
    p = s.proof()
    assert p.reason is Reason.STORAGE_UNBOUND and "profiling" in p.detail
    assert s.revalidate(layers).reason is Reason.STORAGE_UNBOUND  # unchanged, still profiling
    s.unbind()
    assert not s.bound and s.generation == 2
    assert h.events == [(Reason.STORAGE_UNBOUND, "unbind")]
    assert h.sink.reasons == [Reason.STORAGE_UNBOUND]
    assert s.proof().reason is Reason.STORAGE_UNBOUND
    s.unbind()  # idempotent: nothing more happens
    assert s.generation == 2 and len(h.events) == 1
    h.bind_serving()  # the real cache
    assert eligible(s.proof()) and s.generation == 3
    assert len(h.events) == 1


def test_generation_bumps_on_every_bind_and_unbind_not_on_revalidate(h):
    s = h.storage
    seen = [s.generation]
    h.bind_serving()
    seen.append(s.generation)
    assert eligible(s.revalidate(h.layers, h.buffers))  # unchanged: same generation
    assert s.generation == seen[-1]
    s.bind(h.layers, buffers=h.buffers, phase="serving")  # identical rebind: bumps, no event
    seen.append(s.generation)
    s.unbind()
    seen.append(s.generation)
    s.bind(make_layers(), phase="serving")
    seen.append(s.generation)
    assert seen == sorted(set(seen)) and seen[0] == 0
    assert [r for r, _ in h.events] == [Reason.STORAGE_UNBOUND]


def test_rebind_with_new_tensors_while_bound_notifies_once(h):
    s = h.storage
    h.bind_serving()
    old_gen = s.generation
    layers = make_layers()
    ident = s.bind(layers, buffers=h.buffers, phase="serving")
    assert len(h.events) == 1
    reason, detail = h.events[0]
    assert reason is Reason.STORAGE_IDENTITY_CHANGED and detail.startswith("rebind:")
    assert name(0) in detail and "data_ptr" in detail
    assert h.sink.reasons == [Reason.STORAGE_IDENTITY_CHANGED]
    assert s.bound and ident.generation == s.generation > old_gen + 1
    assert s.kv_cache(name(0)) is layers[name(0)]
    # a new generation needs its own device proof
    assert s.proof().reason is Reason.DEVICE_MISMATCH
    assert s.check_devices("cpu", "cpu").holds and eligible(s.proof())


def test_unbind_releases_the_tensors(h):
    s = h.storage
    t = kv_cache()
    ref = weakref.ref(t)
    s.bind({name(0): t}, phase="serving")
    del t
    gc.collect()
    assert ref() is not None, "a bound tensor must stay alive (no address reuse behind a graph)"
    s.unbind()
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("case", ["empty", "3d", "odd", "head_size", "stride", "dup_index",
                                  "indices_names", "no_index", "two_ints", "mixed_devices",
                                  "not_a_tensor"])
def test_bind_rejects_malformed_bindings(h, case):
    s = h.storage
    layers, kwargs = make_layers(2), {}
    if case == "empty":
        layers = {}
    elif case == "3d":
        layers[name(0)] = torch.zeros(NB, HKV, 2 * D)
    elif case == "odd":
        layers[name(0)] = torch.zeros(NB, HKV, BS, 2 * D + 1)
    elif case == "head_size":
        kwargs["head_size"] = 128
    elif case == "stride":
        layers[name(0)] = torch.zeros(NB, HKV, 2 * D, BS).transpose(2, 3)
    elif case == "dup_index":
        kwargs["layer_indices"] = {name(0): 0, name(1): 0}
    elif case == "indices_names":
        kwargs["layer_indices"] = {name(0): 0}
    elif case == "no_index":
        layers["lm_head.attn"] = kv_cache()
    elif case == "two_ints":
        layers["model.layers.1.experts.2.attn"] = kv_cache()
    elif case == "mixed_devices":
        layers[name(1)] = torch.empty(NB, HKV, BS, 2 * D, device="meta")
    elif case == "not_a_tensor":
        layers[name(1)] = [1, 2, 3]
    with pytest.raises(ValueError):
        s.bind(layers, phase="serving", **kwargs)
    assert not s.bound and s.generation == 0 and h.events == []


def test_bind_rejects_unknown_phase(h):
    with pytest.raises(ValueError):
        h.storage.bind(make_layers(), phase="warmup")


def test_layer_indices_explicit_and_parsed():
    assert layer_index_from_name("model.layers.7.self_attn.attn") == 7
    assert layer_index_from_name("3") == 3
    with pytest.raises(ValueError):
        layer_index_from_name("model.layers.7.experts.1.attn")
    s = PagedKVStorage()
    ident = s.bind({"b": kv_cache(), "a": kv_cache()}, phase="serving",
                   layer_indices={"a": 1, "b": 0}, head_size=D)
    assert [(x.name, x.index) for x in ident.layers] == [("b", 0), ("a", 1)]


# ---------------------------------------------------------------------------- listeners / close


def test_listener_remover_and_external_invalidate(h):
    s = h.storage
    calls: list[str] = []
    remove = s.on_invalidate(lambda reason, detail: calls.append(detail))
    h.bind_serving()
    s.invalidate("write proof failed")
    assert calls == ["write proof failed"] and h.events[-1][1] == "write proof failed"
    assert s.proof().reason is Reason.STORAGE_IDENTITY_CHANGED
    remove()
    remove()  # idempotent
    h.bind_serving()
    s.invalidate("again")
    assert calls == ["write proof failed"] and len(h.events) == 2
    s.unbind()  # invalidated -> unbound: no second notification
    assert len(h.events) == 2 and s.proof().reason is Reason.STORAGE_UNBOUND
    s.invalidate("unbound: ignored")
    assert len(h.events) == 2


def test_close_is_idempotent_and_blocks_reuse(h):
    s = h.storage
    h.bind_serving()
    gen = s.generation
    s.close()
    assert s.closed and not s.bound and s.generation == gen + 1
    assert h.events == [(Reason.STORAGE_UNBOUND, "closed")]
    s.close()
    s.unbind()
    assert len(h.events) == 1 and s.generation == gen + 1
    p = s.proof()
    assert p.reason is Reason.STORAGE_UNBOUND and p.detail == "closed"
    assert not s.check_replay(s.owner_id, s.generation).holds
    with pytest.raises(RuntimeError, match="after close"):
        s.bind(make_layers(), phase="serving")
    with pytest.raises(RuntimeError, match="after close"):
        s.revalidate(h.layers)
    with pytest.raises(RuntimeError, match="after close"):
        s.check_devices("cpu", "cpu")
    with pytest.raises(RuntimeError):
        s.identity()
    assert len(h.events) == 1


def test_close_unbound_storage_notifies_nobody(h):
    h.storage.close()
    assert h.events == [] and h.sink.reasons == [] and h.storage.generation == 0
    with pytest.raises(RuntimeError):
        h.storage.bind(make_layers(), phase="profiling")


def test_metrics_recorder_is_an_invalidation_sink(tmp_path):
    """The real MetricsRecorder counts storage invalidations by reason."""
    from vllm_moe_graphs.metrics import MetricsRecorder

    rec = MetricsRecorder(rank=0, directory=None)
    storage = PagedKVStorage(metrics=rec)
    kv = torch.zeros(4, 2, 16, 2 * 8)
    storage.bind({"model.layers.0.self_attn.attn": kv}, phase="serving")
    storage.revalidate({"model.layers.0.self_attn.attn": torch.zeros(4, 2, 16, 2 * 8)})
    child = rec._invalidations[Reason.STORAGE_IDENTITY_CHANGED]
    assert child._value.get() == 1
