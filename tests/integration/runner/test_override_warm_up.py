"""`capture_model` with lazy capture on CPU: the start-up warm-up runs every kernel shape eagerly
through vLLM's `_dummy_run` (decode keys, prefill tiles, the mixed batch, the fused-MoE token
counts) and, with `warm_up_compile_threads`, compiles the fused-MoE variants on threads first."""

from __future__ import annotations

import pytest

gpu_model_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
GPUModelRunner = gpu_model_runner.GPUModelRunner

from tests.integration.runner.bare_runner import _stepping_runner  # noqa: E402


def test_start_up_warm_up_runs_every_kernel_shape_eagerly(caplog):
    """capture_model with lazy capture (the default): before the engine is ready, every graph
    key's decode batch (at its context bucket) and one mixed prefill batch run eagerly through
    vLLM's _dummy_run with attention metadata, and the slot-mapping kernel runs once; no graph
    is captured, no decision made, nothing padded."""
    import dataclasses
    import logging
    import types

    import torch

    from vllm_moe_graphs.graphs.buckets import graph_config

    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    r.max_model_len, r.max_num_tokens = 4096, 8192
    r.moe_graphs.graphs.config = graph_config(
        dataclasses.replace(r.moe_graphs.graphs.config, decode_batch_buckets=(2, 4)), 4, 4096)
    calls, slots = [], []

    def dummy_run(num_tokens, **kw):  # vLLM's _dummy_run, in short: decide, then the model
        calls.append((num_tokens, kw))
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            num_tokens, num_tokens, None, 1, False,
            force_eager=kw["cudagraph_runtime_mode"] is mode_enum.NONE)
        assert mode is mode_enum.NONE and desc.num_tokens == num_tokens  # eager, unpadded
        ids = torch.arange(1, num_tokens + 1, dtype=torch.int32)
        return r._model_forward(input_ids=ids, positions=ids.long())

    r._dummy_run = dummy_run
    r.input_batch.block_table = types.SimpleNamespace(
        compute_slot_mapping=lambda *a: slots.append(a))
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        assert r.capture_model() == 0
    decode = [(n, kw["profile_seq_lens"]) for n, kw in calls if kw.get("uniform_decode")]
    assert decode == [(4, 4096), (4, 2048), (2, 4096), (2, 2048)]
    prefill = [n for n, kw in calls if not kw.get("uniform_decode")]
    # one per prefill tile size (longest query 2..64), then a mixed batch of
    # min(max_num_tokens, max_model_len - 1) tokens: every seq_len stays within max_model_len
    assert prefill == [2, 4, 8, 16, 32, 64, 4095]
    assert [kw.get("create_mixed_batch", False) for n, kw in calls
            if not kw.get("uniform_decode")] == [False] * 6 + [True]
    assert all(kw["force_attention"] and kw["cudagraph_runtime_mode"] is mode_enum.NONE
               for _, kw in calls)
    assert len(slots) == 1 and slots[0][0] == 1 and slots[0][1].tolist() == [0, 1]
    assert capture.captures == 0 and r.moe_graphs.graphs.keys == ()
    assert "kernels warmed up before serving (4 decode batches, 7 prefill batches" in caplog.text
    r.max_model_len = 24  # a short engine: only the tile sizes that fit, every seq_len in bounds
    calls.clear()
    r.capture_model()
    assert [n for n, kw in calls if not kw.get("uniform_decode")] == [2, 4, 8, 16, 23]

    def failing(num_tokens, **kw):  # e.g. a kernel that does not compile for this model
        raise ValueError("no kernel for this shape")

    r._dummy_run = failing
    with pytest.raises(RuntimeError, match="kernel warm-up before serving failed .ValueError: "
                       "no kernel for this shape.*MOE_GRAPHS_DISABLE=1"):
        r.capture_model()


def test_start_up_warm_up_adds_the_fused_moe_token_counts(monkeypatch, caplog):
    """An MoE model: the warm-up's batches call vLLM's fused-MoE config lookup with their token
    count; the counts that reach its other kernel variants then run eagerly without attention
    (any count up to max_num_tokens fits), each once, none the warm-up ran already, through the
    layers up to the first MoE layer (compilation mode NONE; the batches through every layer);
    with a layer on the fused routing, one 2-row forward then runs padded (one real row), so
    that kernel's padding-row variant compiles before serving."""
    import dataclasses
    import logging
    import types

    import torch
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.layers.fused_moe.experts import triton_moe
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel

    from tests.integration.test_model_layer_range import _stack

    from vllm_moe_graphs.graphs.buckets import graph_config
    from vllm_moe_graphs.integration.model.moe_padding import MoePadding

    def lookup(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):  # 0.26's parameters
        return {"BLOCK_SIZE_M": 16 if M <= 40 else 64}

    monkeypatch.setattr(triton_moe, "try_get_optimal_moe_config", lookup)
    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    r.max_model_len, r.max_num_tokens = 64, 100
    r.moe_graphs.graphs.config = graph_config(
        dataclasses.replace(r.moe_graphs.graphs.config, decode_batch_buckets=(2, 4)), 4, 64)
    calls, padded = [], []
    padding = MoePadding(100, "cpu")
    r.moe_graphs.moe_padding = padding  # the padding rows skip the experts (skip_moe_padding)
    padding.rewrite(2, 8)  # a layer on the mask
    r.model = torch.nn.Module()  # vLLM's decoder stack: 4 layers, the first MoE layer at 1
    r.model.model = stack = _stack(Qwen3MoeModel, moe_at=(1, 2, 3), layers=4)
    r.compilation_config.mode = CompilationMode.NONE
    depths = {}

    def dummy_run(num_tokens, **kw):  # the MoE layers look their config up per batch
        if padding.active:  # a padded forward: the fused routing's padding-row variant
            padded.append((num_tokens, kw, padding._real.tolist()))
            return
        calls.append((num_tokens, kw))
        depths.setdefault(stack.end_layer, []).append(num_tokens)
        triton_moe.try_get_optimal_moe_config((8, 32, 16), (8, 16, 16), 2, None, num_tokens)

    r._dummy_run = dummy_run
    r.input_batch.block_table = types.SimpleNamespace(compute_slot_mapping=lambda *a: None)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        r.capture_model()  # the mask compiles nothing: no padded forward
        assert not padded and "a padded MoE forward" not in caplog.text
        calls.clear()
        depths.clear()
        padding.route(2, 8, True)  # a layer on the fused routing
        r.capture_model()
    assert triton_moe.try_get_optimal_moe_config is lookup
    first = [n for n, kw in calls if kw.get("force_attention")]
    assert first == [4, 2, 2, 4, 8, 16, 32, 63]  # decode keys, prefill tiles, mixed
    moe = [(n, kw) for n, kw in calls if not kw.get("force_attention")]
    # groups [1, 40] and [41, 100]; naive path up to 8 // (4 * 2) = 1; BLOCK_SIZE_M 16 and 64
    assert [n for n, _ in moe] == [1, 15, 17, 39, 40, 41, 42, 64, 65, 99, 100]
    assert all(kw["cudagraph_runtime_mode"] is mode_enum.NONE for _, kw in moe)
    assert depths == {4: first, 2: [n for n, _ in moe]} and stack.end_layer == 4
    assert ("6 prefill batches, 11 fused-MoE token counts through 2 layers (up to the first MoE "
            "layer), a padded MoE forward") in caplog.text
    assert padded == [(2, {"cudagraph_runtime_mode": mode_enum.NONE, "skip_eplb": True,
                           "remove_lora": False}, [1])] and not padding.active
    assert capture.captures == 0


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-node", "warm-triton-cache"])
def test_warm_up_compile_threads_records_then_compiles_before_the_runs(monkeypatch, caplog,
                                                                        fresh):
    """`warm_up_compile_threads`: the decode, prefill and mixed batches run with Triton's
    compile hook recording the fused-MoE kernel's uncompiled variants (here each token count
    asks for one, as Triton's JIT would). On a fresh node (Triton builds the attention kernel)
    the fused-MoE token counts are recorded too, all compile on the threads, and only then do
    the token counts run, finding their variants compiled. Where Triton's disk cache held the
    attention kernel, only the batches' variants load on the threads and the token counts run
    as without the setting."""
    import dataclasses
    import logging
    import types

    from triton import knobs
    from triton.runtime import _async_compile
    from triton.runtime.jit import JitFunctionInfo
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    from vllm_moe_graphs.graphs.buckets import graph_config
    from vllm_moe_graphs.integration.startup.moe_warm_up import DEFERRED_KERNEL
    from vllm_moe_graphs.integration.startup.precapture import PREFILL_WARM_UP_TOKENS

    def lookup(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
        return {"BLOCK_SIZE_M": 16}

    monkeypatch.setattr(triton_moe, "try_get_optimal_moe_config", lookup)
    r, _, _ = _stepping_runner(warmup_steps=1)
    r.max_model_len, r.max_num_tokens = 64, 40
    r.moe_graphs.graphs.config = graph_config(
        dataclasses.replace(r.moe_graphs.graphs.config, decode_batch_buckets=(2, 4)), 4, 64)
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, warm_up_compile_threads=2)
    compiled: dict[str, str] = {}
    events: list[tuple] = []

    def compile_(name: str) -> None:  # Triton's compile tells its listener, hit or build
        listener = knobs.compilation.listener
        if listener is not None:
            listener(src=types.SimpleNamespace(name=name), metadata={}, metadata_group={},
                     times=None, cache_hit=not fresh)

    class FusedMoeKernel:  # the JIT function: compiled variants land in its cache
        def preload(self, data: str) -> None:  # JITFunction.preload under the async mode
            def build() -> str:
                compile_("fused_moe_kernel")
                return f"binary {data}"

            _async_compile.active_mode.get().submit(
                data, build, lambda binary: (compiled.__setitem__(data, binary),
                                             events.append(("compiled", data))))

    kernel = FusedMoeKernel()
    info = JitFunctionInfo(*DEFERRED_KERNEL, kernel)

    def dummy_run(num_tokens, **kw):
        if kw.get("force_attention") and not events:
            compile_("_paged_decode_kernel")
        triton_moe.try_get_optimal_moe_config((8, 32, 16), (8, 16, 16), 2, None, num_tokens)
        variant = f"M={num_tokens}"
        if variant in compiled:
            events.append(("ran", num_tokens))
            return
        hook = knobs.runtime.jit_cache_hook  # Triton's JIT before it compiles a variant
        if hook is None:
            compile_("fused_moe_kernel")
            compiled[variant] = f"binary {variant}"
            events.append(("compiled inline", num_tokens))
            return
        skipped = hook(key=variant, repr=variant, fn=info,
                       compile={"key": variant, "specialization_data": variant},
                       is_manual_warmup=False, already_compiled=False)
        events.append(("recorded" if skipped else "compiled inline", num_tokens))

    r._dummy_run = dummy_run
    r.input_batch.block_table = types.SimpleNamespace(compute_slot_mapping=lambda *a: None)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.compilation, "listener", None)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        r.capture_model()
    # decode batches 2 and 4, the prefill batches up to 40 tokens, the mixed batch of 40; then
    # one group [1, 40]: its ends, the naive path's (1), BLOCK_SIZE_M's 16 +- 1
    decode = [k.batch_bucket for k in r.moe_graphs.graphs.all_keys()]
    assert sorted(decode) == [2, 4]
    batches = decode + [n for n in PREFILL_WARM_UP_TOKENS if n <= 40] + [40]
    counts = [1, 15, 17, 39]
    recorded = batches + counts if fresh else batches
    variants = set(recorded)
    assert [e for e in events if e[0] == "recorded"] == [("recorded", n) for n in recorded]
    assert sorted(e[1] for e in events if e[0] == "compiled") == sorted(f"M={n}"
                                                                         for n in variants)
    compiles_end = max(i for i, e in enumerate(events) if e[0] == "compiled") + 1
    assert all(e[0] == "compiled" for e in events[len(recorded):compiles_end])
    runs = [("ran", n) for n in counts] if fresh else [("compiled inline", n) for n in counts]
    assert events[compiles_end:] == runs
    assert knobs.runtime.jit_cache_hook is None and knobs.compilation.listener is None
    built = len(variants) if fresh else 0
    assert (f"{len(variants)} fused-MoE kernel variants of {len(variants)} token counts "
            f"(1..40) compiled on 2 threads" if fresh else
            f"{len(variants)} fused-MoE kernel variants of {len(variants)} token counts "
            f"(2..40) compiled on 2 threads") in caplog.text
    assert f"{built} built, the rest from Triton's cache" in caplog.text


@pytest.mark.parametrize("threads", [0, 2])
def test_warm_up_touches_tritons_knobs_only_with_compile_threads(monkeypatch, threads):
    """`warm_up_compile_threads: 0` (the setting's rollback) runs the warm-up with Triton's
    compile hook and compilation listener as they were; with threads the warm-up installs its
    own for its batches; after it, both are back either way."""
    import dataclasses
    import types

    from triton import knobs

    def hook(**kwargs):
        return None

    def listener(**kwargs):
        return None

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    monkeypatch.setattr(knobs.compilation, "listener", listener)
    r, _, _ = _stepping_runner(warmup_steps=1)
    r.max_model_len, r.max_num_tokens = 64, 40
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config,
                                              warm_up_compile_threads=threads)
    seen: list[bool] = []
    r._dummy_run = lambda n, **kw: seen.append(knobs.runtime.jit_cache_hook is hook
                                               and knobs.compilation.listener is listener)
    r.input_batch.block_table = types.SimpleNamespace(compute_slot_mapping=lambda *a: None)
    r.capture_model()
    assert seen and seen == [threads == 0] * len(seen)
    assert knobs.runtime.jit_cache_hook is hook and knobs.compilation.listener is listener
