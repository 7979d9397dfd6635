"""PagedKVStorage: bind / unbind / rebind, every identity change, generations, listeners, close."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from vllm_moe_graphs.capability import Proof, Reason
from vllm_moe_graphs.kv import PagedKVStorage, Phase, StorageIdentity, layer_index_from_name

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


@pytest.fixture
def h() -> Harness:
    return Harness()


def eligible(p: Proof) -> bool:
    return p == Proof("storage", Reason.ELIGIBLE)


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


# ---------------------------------------------------------------------------- identity changes


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
