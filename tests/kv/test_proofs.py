"""The per-layer KV write proof: passes with a correct writer, fails with a writer that writes
into the wrong layer, also into another layer, or nowhere; the reserved slots are restored."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before vllm_moe_graphs.ops is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from unittest import mock  # noqa: E402

import pytest  # noqa: E402

from vllm_moe_graphs.capability import Proof, Reason  # noqa: E402
from vllm_moe_graphs.kv import PagedKVStorage  # noqa: E402
from vllm_moe_graphs.kv.proofs import RESERVED_SLOT, prove_kv_writes, sentinel  # noqa: E402
from vllm_moe_graphs.ops import split_kv_cache, write_kv  # noqa: E402
from vllm_moe_graphs.ops.reference import reference_write_kv  # noqa: E402

HKV, BS, D = 2, 16, 64
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def random_cache(nb: int, dtype: torch.dtype, layout: str, device: str = "cpu"
                 ) -> torch.Tensor:
    """Random finite values, in the TRITON_ATTN logical [NB, Hkv, BS, 2D] shape."""
    if layout == "nhd":
        return torch.randn(nb, BS, HKV, 2 * D).to(dtype).to(device).permute(0, 2, 1, 3)
    return torch.randn(nb, HKV, BS, 2 * D).to(dtype).to(device)


def bound_storage(n: int = 3, nb: int = 3, dtype: torch.dtype = torch.bfloat16,
                  layout: str = "nhd", device: str = "cpu"
                  ) -> tuple[PagedKVStorage, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    layers = {name(i): random_cache(nb, dtype, layout, device) for i in range(n)}
    storage = PagedKVStorage()
    storage.bind(layers, phase="serving")
    return storage, layers


def snapshot(layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.view(_BITS[t.dtype]).clone() for n, t in layers.items()}


def assert_untouched(layers: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    for n, t in layers.items():
        assert torch.equal(t.view(_BITS[t.dtype]), before[n]), f"{n} not restored"


class Redirect:
    """A writer that hands each write to `target(i)`'s cache views instead of (or as well as)
    the ones it was given: the wrong-layer and spill bugs the proof must catch."""

    def __init__(self, layers: dict[str, torch.Tensor], target, also_correct: bool) -> None:
        self.views = [split_kv_cache(t, D) for t in layers.values()]
        self.target, self.also_correct = target, also_correct

    def __call__(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        i = next(j for j, (k, _) in enumerate(self.views) if k.data_ptr() == key_cache.data_ptr())
        if self.also_correct:
            reference_write_kv(key, value, key_cache, value_cache, slot_mapping)
        j = self.target(i)  # no wrap-around: a spill past the last layer goes nowhere
        if 0 <= j < len(self.views):
            reference_write_kv(key, value, *self.views[j], slot_mapping)


# ---------------------------------------------------------------------------- pure-torch writers


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_correct_writer_proves_and_restores(layout, dtype):
    storage, layers = bound_storage(dtype=dtype, layout=layout)
    before = snapshot(layers)
    spy = mock.Mock(wraps=reference_write_kv)
    assert prove_kv_writes(storage, spy) == Proof("kv_write", Reason.ELIGIBLE)
    assert spy.call_count == 2 * len(layers)  # one write per layer in each of the two passes
    key, value, key_cache, _, slot_mapping = spy.call_args_list[0].args
    assert key.shape == value.shape == (1, HKV, D) and key.dtype == dtype
    assert slot_mapping.tolist() == [RESERVED_SLOT] and slot_mapping.dtype == torch.int64
    assert key_cache.data_ptr() == split_kv_cache(layers[name(0)], D)[0].data_ptr()
    assert_untouched(layers, before)


def test_nonzero_slot_in_a_later_block():
    storage, layers = bound_storage(nb=3)
    before = snapshot(layers)
    assert prove_kv_writes(storage, reference_write_kv, slot=BS + 5).holds
    assert_untouched(layers, before)


@pytest.mark.parametrize("bug,target,also_correct", [
    ("next layer instead", lambda i: i + 1, False),
    ("previous layer instead", lambda i: i - 1, False),
    ("always layer 0", lambda i: 0, False),
    ("also into the next layer", lambda i: i + 1, True),
    ("also into the previous layer", lambda i: i - 1, True),
])
def test_wrong_layer_writers_fail_and_slots_are_restored(bug, target, also_correct):
    storage, layers = bound_storage(n=4)
    before = snapshot(layers)
    p = prove_kv_writes(storage, Redirect(layers, target, also_correct))
    assert p.name == "kv_write" and p.reason is Reason.STORAGE_IDENTITY_CHANGED, bug
    assert "layers" in p.detail and "model.layers." in p.detail
    assert_untouched(layers, before)  # every scribbled slot was a reserved slot: restored


def test_writer_that_writes_nothing_fails_every_layer():
    storage, layers = bound_storage(n=3)
    before = snapshot(layers)
    p = prove_kv_writes(storage, lambda *args: None)
    assert p.reason is Reason.STORAGE_IDENTITY_CHANGED
    assert p.detail.startswith("3/3 layers") and all(name(i) in p.detail for i in range(3))
    assert_untouched(layers, before)


def test_writer_into_the_wrong_slot_fails():
    storage, layers = bound_storage()

    def off_by_one(key, value, key_cache, value_cache, slot_mapping):
        reference_write_kv(key, value, key_cache, value_cache, slot_mapping + 1)

    before = snapshot(layers)
    assert not prove_kv_writes(storage, off_by_one).holds
    # the proof restores its reserved slot only: the off-by-one slot keeps the sentinel
    changed = [n for n, t in layers.items() if not torch.equal(t.view(torch.int16), before[n])]
    assert changed == list(layers)


def test_backend_caches_that_are_not_the_owned_tensors_fail():
    storage, layers = bound_storage(n=3)
    names = list(layers)
    before = snapshot(layers)
    swapped = {names[0]: layers[names[1]], names[1]: layers[names[0]], names[2]: layers[names[2]]}
    p = prove_kv_writes(storage, reference_write_kv, caches=swapped)
    assert p.reason is Reason.STORAGE_IDENTITY_CHANGED
    assert names[0] in p.detail and names[1] in p.detail and names[2] not in p.detail
    foreign = {n: t.clone() for n, t in layers.items()}  # e.g. a stale profiling cache
    assert prove_kv_writes(storage, reference_write_kv, caches=foreign).detail.startswith("3/3")
    assert_untouched(layers, before)
    assert prove_kv_writes(storage, reference_write_kv, caches=dict(layers)).holds


def test_writer_exception_propagates_after_restoring():
    storage, layers = bound_storage(n=2)
    before = snapshot(layers)
    calls = []

    def fails_on_second(key, value, key_cache, value_cache, slot_mapping):
        calls.append(1)
        reference_write_kv(key, value, key_cache, value_cache, slot_mapping)
        if len(calls) == 2:
            raise RuntimeError("kernel launch failed")

    with pytest.raises(RuntimeError, match="kernel launch failed"):
        prove_kv_writes(storage, fails_on_second)
    assert_untouched(layers, before)


def test_unbound_storage_and_bad_arguments():
    assert prove_kv_writes(PagedKVStorage(), reference_write_kv).reason is (
        Reason.STORAGE_UNBOUND)
    storage, layers = bound_storage(n=2, nb=2)
    with pytest.raises(ValueError, match="outside"):
        prove_kv_writes(storage, reference_write_kv, slot=2 * BS)
    with pytest.raises(ValueError, match="outside"):
        prove_kv_writes(storage, reference_write_kv, slot=-1)
    with pytest.raises(ValueError, match="caches"):
        prove_kv_writes(storage, reference_write_kv, caches={name(0): layers[name(0)]})
    storage.unbind()
    assert prove_kv_writes(storage, reference_write_kv).reason is Reason.STORAGE_UNBOUND


def test_sentinels_are_distinct_and_exact():
    pats = [sentinel(c, HKV, D, torch.bfloat16, torch.device("cpu")) for c in range(0, 2000, 7)]
    flat = torch.stack([p.view(-1) for p in pats])
    assert len({tuple(r.tolist()) for r in flat}) == len(pats)
    exact = sentinel(1234, HKV, D, torch.float32, torch.device("cpu"))
    assert torch.equal(sentinel(1234, HKV, D, torch.bfloat16, torch.device("cpu")).float(), exact)


# ---------------------------------------------------------------------------- the real kernel


def _kernel_runs_here() -> bool:
    if torch.cuda.is_available():
        return True
    from triton.runtime.interpreter import InterpretedFunction

    from vllm_moe_graphs.ops import kv_write

    return isinstance(kv_write._write_kv_kernel, InterpretedFunction)


@pytest.mark.skipif(not _kernel_runs_here(),
                    reason="vllm_moe_graphs.ops was imported before TRITON_INTERPRET=1 was set")
def test_real_write_kv_kernel():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    storage, layers = bound_storage(n=2, nb=2, dtype=torch.bfloat16, device=device)
    before = snapshot(layers)
    assert prove_kv_writes(storage, write_kv, slot=BS + 3) == Proof("kv_write", Reason.ELIGIBLE)
    assert_untouched(layers, before)
    names = list(layers)
    swapped = {names[0]: layers[names[1]], names[1]: layers[names[0]]}
    p = prove_kv_writes(storage, write_kv, caches=swapped)
    assert p.reason is Reason.STORAGE_IDENTITY_CHANGED and p.detail.startswith("2/2")
    assert_untouched(layers, before)
