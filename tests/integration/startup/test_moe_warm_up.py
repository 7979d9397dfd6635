"""The fused-MoE part of the start-up warm-up (integration/startup/moe_warm_up.py), against
vLLM 0.26's real config lookup (`try_get_optimal_moe_config`, its tuned H200 table and its
defaults)."""

from __future__ import annotations

import pytest

from vllm_moe_graphs.integration.startup.moe_warm_up import (
    MoeCall,
    moe_token_counts,
    recording_moe_configs,
)

# Qwen3-30B-A3B's experts at TP 1: w13 [E, 2 * 768, 2048], w2 [E, 2048, 768], top-k 8.
W1, W2, TOP_K = (128, 1536, 2048), (128, 2048, 768), 8


@pytest.fixture
def device_named(monkeypatch):
    """vLLM's config lookup reads the GPU's name (a tuned table per GPU); name one."""
    from vllm.platforms import current_platform

    def named(name: str) -> None:
        monkeypatch.setattr(type(current_platform), "get_device_name",
                            classmethod(lambda cls, device_id=0: name))
    return named


def _vllm_lookup():
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    return triton_moe


def test_recording_sees_vllms_lookup_and_puts_it_back(device_named):
    device_named("NVIDIA H200")
    module = _vllm_lookup()
    original = module.try_get_optimal_moe_config
    with recording_moe_configs() as calls:
        assert module.try_get_optimal_moe_config is not original
        got = module.try_get_optimal_moe_config(W1, W2, TOP_K, None, 5)
        module.try_get_optimal_moe_config(W1, W2, top_k=TOP_K, dtype=None, M=300)  # same layer
    assert module.try_get_optimal_moe_config is original
    assert len(calls) == 1 and (calls[0].num_experts, calls[0].top_k) == (128, TOP_K)
    assert got == original(W1, W2, TOP_K, None, 5) == calls[0].config_of(5)
    assert calls[0].config_of(3000) == original(W1, W2, TOP_K, None, 3000) != got


def _variants(call: MoeCall, m: int) -> tuple:
    """What vLLM 0.26's fused_moe_kernel launch specialises on for Qwen3-MoE's shapes: the
    config, the naive path, M * top_k divisible by 16 (the valid and, E * (BLOCK_M - 1) being
    a multiple of 16, the padded token counts), and M below BLOCK_SIZE_M."""
    cfg = call.config_of(m)
    return (repr(sorted(cfg.items())), m * call.top_k * 4 <= call.num_experts,
            m * call.top_k % 16 == 0, m < cfg["BLOCK_SIZE_M"])


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "no tuned table"])
def test_token_counts_reach_every_kernel_variant(device_named, gpu):
    device_named(gpu)
    module = _vllm_lookup()
    with recording_moe_configs() as calls:
        module.try_get_optimal_moe_config(W1, W2, TOP_K, None, 1)
    limit, done = 8192, [1, 2, 4, 8, 16, 32, 64, 8191]
    counts = moe_token_counts(calls, limit, done)
    assert counts == sorted(set(counts)) and not set(counts) & set(done)
    assert all(1 <= m <= limit for m in counts)
    every = {_variants(calls[0], m) for m in range(1, limit + 1)}
    reached = {_variants(calls[0], m) for m in counts + done}
    assert reached == every
    assert len(counts) < 80  # a few per config group, not every token count


def test_nothing_recorded_nothing_added():
    assert moe_token_counts([], 8192, [1, 2]) == []
    with recording_moe_configs() as calls:
        pass  # a dense model: vLLM's MoE lookup is never called
    assert calls == []


def test_a_changed_lookup_is_left_alone(monkeypatch, caplog):
    module = _vllm_lookup()

    def drifted(w1_shape, w2_shape, top_k, dtype, num_tokens, block_shape=None):
        return {}

    monkeypatch.setattr(module, "try_get_optimal_moe_config", drifted)
    with recording_moe_configs() as calls:
        assert module.try_get_optimal_moe_config is drifted  # not wrapped
    assert calls == [] and "fused-MoE token counts are left out" in caplog.text


def test_deferring_records_vllms_fused_moe_kernel_and_passes_the_rest_on(monkeypatch):
    """`warm_up_compile_threads`' record: Triton's JIT asks `jit_cache_hook` before a compile
    (as `JITFunction._call_hook` does); vLLM's `fused_moe_kernel` is recorded once per cache
    key and skipped (True: no compile, no launch) with its output zeroed, any other kernel
    goes to the hook that was there; afterwards both hooks are as they were."""
    import types

    import torch
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo
    from vllm.model_executor.layers.fused_moe import fused_moe

    from vllm_moe_graphs.integration.startup.moe_warm_up import (
        DEFERRED_KERNEL,
        deferring_fused_moe_compiles,
    )

    kernel = fused_moe.fused_moe_kernel
    fn = getattr(kernel, "fn", kernel)  # without a GPU, vLLM's Triton stand-in leaves the function
    assert (fn.__module__, fn.__qualname__) == DEFERRED_KERNEL  # where vLLM 0.26 defines it
    seen: list[str] = []

    def previous(**kwargs):
        seen.append(kwargs["fn"].name)
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", previous)

    def ask(info, key: str):  # Triton's keyword arguments to the hook
        return knobs.runtime.jit_cache_hook(
            key=key, repr="r", fn=info, compile={"key": key, "specialization_data": f"data {key}"},
            is_manual_warmup=False, already_compiled=False)

    moe = JitFunctionInfo(fn.__module__, fn.__qualname__, kernel)
    other = JitFunctionInfo("vllm_moe_graphs.ops.paged_decode", "_paged_decode_kernel", object())
    # on a GPU the kernel is Triton's JIT function, whose pre-run hooks see each launch's
    # arguments (A, B, C, ...) first: the output C is zeroed for a launch that will be skipped
    jit = types.SimpleNamespace(pre_run_hooks=[])
    monkeypatch.setattr(fused_moe, "fused_moe_kernel", jit)
    out = torch.full((2, 3), float("nan"))
    with deferring_fused_moe_compiles() as deferred:
        assert ask(moe, "k1") is True and ask(moe, "k2") is True and ask(moe, "k1") is True
        assert ask(other, "k3") is False
        (zero,) = jit.pre_run_hooks
        zero(torch.ones(2), torch.ones(2), out, 7, top_k=8)
        assert out.eq(0).all()
    assert deferred == {"k1": (kernel, "data k1"), "k2": (kernel, "data k2")}
    assert seen == ["_paged_decode_kernel"]
    assert knobs.runtime.jit_cache_hook is previous and jit.pre_run_hooks == []


def test_compile_in_parallel_compiles_on_threads_before_it_returns():
    """The recorded kernels are preloaded under Triton's asynchronous compile mode: each
    compile runs on the pool's threads (four at once here: the barrier breaks unless all four
    wait together) and lands in its kernel's cache before `compile_in_parallel` returns."""
    import threading

    from triton.runtime import _async_compile

    from vllm_moe_graphs.integration.startup.moe_warm_up import compile_in_parallel

    barrier, cache, threads = threading.Barrier(4, timeout=10), {}, set()

    class Kernel:  # what JITFunction.preload -> _do_compile does under the async mode
        def preload(self, data: str) -> None:
            mode = _async_compile.active_mode.get()
            assert mode is not None

            def compile_() -> str:
                threads.add(threading.current_thread().name)
                barrier.wait()
                return f"binary {data}"

            mode.submit(data, compile_, lambda binary: cache.__setitem__(data, binary))

    specs = [(Kernel(), f"variant {i}") for i in range(4)]
    assert compile_in_parallel(specs, threads=4) == (4, 0)
    assert cache == {f"variant {i}": f"binary variant {i}" for i in range(4)}
    assert len(threads) == 4 and all(t.startswith("moe_graphs-compile") for t in threads)
    assert _async_compile.active_mode.get() is None
    assert compile_in_parallel([], threads=4) == (0, 0)


def test_counting_triton_builds_counts_what_the_disk_cache_lacked(monkeypatch):
    """Triton's compilation listener reports every compile, with `cache_hit` for a variant its
    disk cache held; inside the block the builds are counted by kernel name, from any thread,
    and the listener that was there before hears every compile; on leaving it is back."""
    import threading
    import types

    from triton import knobs

    from vllm_moe_graphs.integration.startup.moe_warm_up import counting_triton_builds

    heard: list[bool] = []
    previous = lambda **kw: heard.append(kw["cache_hit"])  # noqa: E731
    monkeypatch.setattr(knobs.compilation, "listener", previous)

    def compile_(name: str, hit: bool) -> None:
        knobs.compilation.listener(src=types.SimpleNamespace(name=name), metadata={},
                                   metadata_group={}, times=None, cache_hit=hit)

    with counting_triton_builds() as built:
        compile_("_paged_decode_kernel", True)
        worker = threading.Thread(target=compile_, args=("fused_moe_kernel", False))
        worker.start()
        worker.join()
        compile_("_write_kv_kernel", False)
    assert built == ["fused_moe_kernel", "_write_kv_kernel"]
    assert heard == [True, False, False]
    assert knobs.compilation.listener is previous


def test_deferring_fused_moe_compiles_restores_both_hooks_when_the_block_raises(monkeypatch):
    """A warm-up that raises inside the block leaves Triton's JIT hook and the kernel's pre-run
    hooks as they were; a kernel without pre-run hooks (vLLM without a GPU) is left alone."""
    import types

    from triton import knobs
    from vllm.model_executor.layers.fused_moe import fused_moe

    from vllm_moe_graphs.integration.startup.moe_warm_up import deferring_fused_moe_compiles

    previous = knobs.runtime.jit_cache_hook
    jit = types.SimpleNamespace(pre_run_hooks=["theirs"])
    monkeypatch.setattr(fused_moe, "fused_moe_kernel", jit)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        with deferring_fused_moe_compiles():
            assert jit.pre_run_hooks[0] == "theirs" and len(jit.pre_run_hooks) == 2
            raise RuntimeError("warm-up failed")
    assert jit.pre_run_hooks == ["theirs"] and knobs.runtime.jit_cache_hook is previous

    plain = object()
    monkeypatch.setattr(fused_moe, "fused_moe_kernel", plain)
    with deferring_fused_moe_compiles():
        assert knobs.runtime.jit_cache_hook is not previous
    assert knobs.runtime.jit_cache_hook is previous
