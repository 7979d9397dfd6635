"""The runner's KV-cache hooks on a runner built without vLLM's `__init__` (CPU only): vLLM's own
method bodies run under the overrides (profiling-cache cleanup, wake-up revalidation, the
per-step swap check, metadata builders reading vLLM's buffers in place)."""

from __future__ import annotations

import pytest

gpu_model_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
GPUModelRunner = gpu_model_runner.GPUModelRunner

from vllm_moe_graphs.integration.runner import buffers  # noqa: E402
from tests.integration.runner.bare_runner import _bare_runner, _kv  # noqa: E402


def test_cleanup_unbinds_before_vllm_frees_the_cache():
    r = _bare_runner({"model.layers.0.self_attn.attn": _kv()})
    # vLLM's body starts with torch.accelerator.synchronize(): raises without a GPU, which
    # shows our unbind ran before super() (and before vLLM dropped its references).
    try:
        r._cleanup_profiling_kv_cache()
    except RuntimeError:
        assert len(r.kv_caches) == 1, "vLLM's body ran: this host has an accelerator"
    assert not r.moe_graphs.storage.bound
    assert r.moe_graphs.storage.proof().reason.value == "storage_unbound"


def test_wake_up_revalidates_the_bound_identity():
    name = "model.layers.0.self_attn.attn"
    r = _bare_runner({name: _kv()})
    gen = r.moe_graphs.storage.generation
    r.post_kv_cache_wake_up()  # vLLM's body: no-op for an unquantized cache
    assert r.moe_graphs.storage.bound and r.moe_graphs.storage.generation == gen

    r.compilation_config.static_forward_context[name].kv_cache = _kv(8)  # reallocated
    r.post_kv_cache_wake_up()
    proof = r.moe_graphs.storage.proof()
    assert proof.reason.value == "storage_identity_changed"
    assert "shape" in proof.detail and name in proof.detail


def test_wake_up_notices_a_moved_input_buffer():
    import torch

    r = _bare_runner({"model.layers.0.self_attn.attn": _kv()})
    r.positions = torch.zeros(8, dtype=torch.int64)  # vLLM reallocated a persistent buffer
    r.post_kv_cache_wake_up()
    proof = r.moe_graphs.storage.proof()
    assert proof.reason.value == "storage_identity_changed" and "positions" in proof.detail


def test_a_swapped_layer_tensor_is_seen_by_the_per_step_check():
    name = "model.layers.0.self_attn.attn"
    r = _bare_runner({name: _kv()})
    assert not r.moe_graphs.kv_rebound()
    r.compilation_config.static_forward_context[name].kv_cache = _kv()  # same shape, new tensor
    assert r.moe_graphs.kv_rebound()
    r.moe_graphs.rebind("test swap")
    assert r.moe_graphs.storage.proof().reason.value == "storage_identity_changed"


def test_bind_lets_our_metadata_builders_read_vllm_buffers_in_place():
    import types

    from vllm_moe_graphs.integration.attention.metadata import MoeGraphsMetadataBuilder

    class Recording(MoeGraphsMetadataBuilder):
        def __init__(self) -> None:  # no vLLM config needed: only read_in_place is called
            self.calls = []

        def read_in_place(self, *buffers) -> None:
            self.calls.append(buffers)

    r = _bare_runner({"model.layers.0.self_attn.attn": _kv()})
    ours, theirs = Recording(), types.SimpleNamespace()  # another backend's builder: left alone
    r.attn_groups = [[types.SimpleNamespace(get_metadata_builder=lambda: ours),
                      types.SimpleNamespace(get_metadata_builder=lambda: theirs)]]
    table = r.input_batch.block_table.block_tables[0].block_table.gpu
    for mode, calls in (("FULL_DECODE_ONLY", 0), ("NONE", 1)):
        r.compilation_config.cudagraph_mode = types.SimpleNamespace(name=mode)
        # another backend's builder also serves this model: replays keep building metadata
        assert buffers.read_metadata_in_place(r) is False
        assert len(ours.calls) == calls, mode  # vLLM's own capture rewrites seq_lens: not then
    ((qsl, seq_lens, block_table),) = ours.calls
    assert qsl is r.query_start_loc.gpu and seq_lens is r.seq_lens and block_table is table
    r.attn_groups = [[types.SimpleNamespace(get_metadata_builder=lambda: ours)]]
    assert buffers.read_metadata_in_place(r) is True  # ours alone, read in place
    r.routed_experts_initialized = True  # vLLM's routed-experts capture reads the metadata
    assert buffers.read_metadata_in_place(r) is False
