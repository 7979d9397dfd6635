"""The V1 runner/worker override points against the installed vLLM 0.26.0 (CPU only)."""

from __future__ import annotations

import contextlib
import inspect
import re

import pytest

gpu_model_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
GPUModelRunner = gpu_model_runner.GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from vllm_moe_graphs.integration import worker  # noqa: E402
from vllm_moe_graphs.integration.runner import buffers, model_runner  # noqa: E402
from vllm_moe_graphs.integration.runner.model_runner import MoeGraphsModelRunner  # noqa: E402
from vllm_moe_graphs.integration.signatures import (  # noqa: E402
    RUNNER_CALLED,
    RUNNER_OVERRIDES,
    IncompatibleVllmError,
    check_runner_points,
)
from vllm_moe_graphs.integration.worker import (  # noqa: E402
    MoeGraphsWorker,
    check_worker_points,
)
from vllm_moe_graphs.integration.patch.runner_class import substituted  # noqa: E402

_ROW = re.compile(r"^`(\w+)`\s*\|([^|]*)\|", re.MULTILINE)


def test_modules_import_on_cpu_and_subclass_vllm():
    assert issubclass(MoeGraphsModelRunner, GPUModelRunner)
    assert issubclass(MoeGraphsWorker, Worker)
    assert MoeGraphsWorker.runner_cls is MoeGraphsModelRunner


def test_override_points_match_installed_vllm():
    check_runner_points()
    check_worker_points()


def test_drifted_runner_signature_is_named():
    class DriftedRunner(GPUModelRunner):
        def initialize_kv_cache(self, kv_cache_config):  # lost is_profiling
            raise AssertionError("never called")

    with pytest.raises(IncompatibleVllmError, match=r"DriftedRunner\.initialize_kv_cache") as e:
        check_runner_points(DriftedRunner)
    assert "'is_profiling'" in str(e.value)  # expected vs found


def test_missing_called_method_is_named():
    class NoGetModel:  # a runner base without get_model, everything else like 0.26
        pass

    for name, params in RUNNER_OVERRIDES.items():
        setattr(NoGetModel, name, _fn_with(params))
    with pytest.raises(IncompatibleVllmError, match=r"NoGetModel\.get_model.*does not exist"):
        check_runner_points(NoGetModel)


def _fn_with(params: tuple[str, ...]):
    ns: dict = {}
    exec(f"def f({', '.join(params)}): pass", ns)  # noqa: S102 - builds a real signature
    return ns["f"]


def test_drifted_worker_signature_is_named():
    class DriftedWorker(Worker):
        def init_device(self, device):
            raise AssertionError("never called")

    with pytest.raises(IncompatibleVllmError, match=r"DriftedWorker\.init_device"):
        check_worker_points(DriftedWorker)


def test_overrides_are_exactly_the_docstring_table():
    table = {name: tuple(p.strip() for p in params.split(",") if p.strip())
             for name, params in _ROW.findall(model_runner.__doc__)}
    assert table == {name: params[1:] for name, params in RUNNER_OVERRIDES.items()}

    own = {n for n, v in MoeGraphsModelRunner.__dict__.items() if inspect.isfunction(v)}
    overridden = {n for n in own if hasattr(GPUModelRunner, n)}
    assert overridden == set(RUNNER_OVERRIDES)
    helpers = own - overridden
    assert not helpers, f"the runner forwards to GraphLifecycle; it defines no helpers: {helpers}"
    assert not set(RUNNER_CALLED) & own

    for name, params in RUNNER_OVERRIDES.items():  # same parameters and defaults as vLLM's
        ours = inspect.signature(MoeGraphsModelRunner.__dict__[name]).parameters
        theirs = inspect.signature(getattr(GPUModelRunner, name)).parameters
        assert tuple(ours) == params == tuple(theirs), name
        assert [p.default for p in ours.values()] == [p.default for p in theirs.values()], name


def test_worker_overrides_keep_vllm_signatures():
    for name, params in worker.WORKER_OVERRIDES.items():
        ours = inspect.signature(MoeGraphsWorker.__dict__[name]).parameters
        theirs = inspect.signature(getattr(Worker, name)).parameters
        assert tuple(ours) == params == tuple(theirs), name
        assert [p.default for p in ours.values()] == [p.default for p in theirs.values()], name


class _RaisingRunner(MoeGraphsModelRunner):
    def __init__(self, vllm_config, device):
        raise RuntimeError("runner init failed")


def test_substitution_restores_module_attribute_when_runner_init_raises():
    # What Worker.init_device does: a local import of the module attribute, then construction.
    with pytest.raises(RuntimeError, match="runner init failed"):
        with substituted(_RaisingRunner):
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GPUModelRunnerV1

            assert GPUModelRunnerV1 is _RaisingRunner
            GPUModelRunnerV1(None, None)
    assert gpu_model_runner.GPUModelRunner is GPUModelRunner


def test_substitution_refuses_a_non_subclass():
    with pytest.raises(TypeError, match="must subclass"):
        with substituted(int):
            pass
    assert gpu_model_runner.GPUModelRunner is GPUModelRunner


class _CpuDeviceConfig:
    """A device config whose device is the CPU; records the runner attribute when read."""

    def __init__(self) -> None:
        self.seen: list[type] = []

    @property
    def device_type(self) -> str:
        self.seen.append(gpu_model_runner.GPUModelRunner)
        return "cpu"

    device = "cpu"


def test_worker_init_device_restores_module_attribute_when_vllm_raises():
    # vLLM's real Worker.init_device raises for a non-CUDA device, inside our window.
    w = MoeGraphsWorker.__new__(MoeGraphsWorker)  # __init__ needs a full VllmConfig
    w.device_config = _CpuDeviceConfig()
    w.use_v2_model_runner = False
    with pytest.raises(RuntimeError, match="Unsupported device type"):
        w.init_device()
    assert w.device_config.seen == [MoeGraphsModelRunner]
    assert gpu_model_runner.GPUModelRunner is GPUModelRunner


def test_worker_leaves_the_v2_runner_alone():
    w = MoeGraphsWorker.__new__(MoeGraphsWorker)
    w.device_config = _CpuDeviceConfig()
    w.use_v2_model_runner = True
    with pytest.raises(RuntimeError, match="Unsupported device type"):
        w.init_device()
    assert w.device_config.seen == [GPUModelRunner]


# -- hooks on a runner built without vLLM's __init__ (it needs CUDA); vLLM's own method bodies run.
def _kv(num_blocks: int = 4):
    import torch

    return torch.zeros(num_blocks, 2, 16, 2 * 8)  # [NB, Hkv, BS, 2 * D]


def _bare_runner(layers: dict):
    import types

    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.integration.runner.lifecycle import GraphLifecycle
    from vllm_moe_graphs.kv.storage import PagedKVStorage, Phase

    import torch

    ns = types.SimpleNamespace
    r = MoeGraphsModelRunner.__new__(MoeGraphsModelRunner)
    r.moe_graphs = GraphLifecycle(r, PluginConfig(), PagedKVStorage())
    r.sampler_compile = r.sampling_variants = None  # as __init__ leaves them
    r.device = torch.device("cpu")
    r.cache_config = ns(cache_dtype="auto", num_gpu_blocks=4)
    ctx = {name: ns(kv_cache=t) for name, t in layers.items()}
    r.compilation_config = ns(static_forward_context=ctx)
    r.kv_caches = list(layers.values())
    # vLLM's persistent input buffers, as GPUModelRunner.__init__ makes them (small)
    r.input_ids, r.query_start_loc = ns(gpu=torch.zeros(8, dtype=torch.int32)), ns(
        gpu=torch.zeros(9, dtype=torch.int32))
    r.positions, r.seq_lens = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    r.input_batch = ns(block_table=ns(block_tables=[ns(
        block_table=ns(gpu=torch.zeros(8, 4, dtype=torch.int32)),
        slot_mapping=ns(gpu=torch.zeros(8, dtype=torch.int64)))]))
    r.attn_groups = []
    r.moe_graphs.storage.bind(layers, phase=Phase.SERVING,
                              buffers=buffers.graph_buffers(r))
    r.moe_graphs.watch_kv(layers)
    return r


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


def test_our_runner_attributes_do_not_collide_with_vllm():
    # vLLM's runner has its own `_moe_*` attributes (e.g. `_moe_model` for EPLB); every name our
    # subclass assigns or defines must be one vLLM's GPUModelRunner never uses.
    ours_src = inspect.getsource(MoeGraphsModelRunner)
    ours = set(re.findall(r"self\.(\w+)\s*(?::[^=]+)?=[^=]", ours_src))
    ours |= {n for n in MoeGraphsModelRunner.__dict__ if not n.startswith("__")}
    ours -= set(RUNNER_OVERRIDES) | set(RUNNER_CALLED) | {"model"}  # `model` is swapped on purpose (precapture)
    theirs = set(re.findall(r"self\.(\w+)", inspect.getsource(gpu_model_runner)))
    assert ours and not ours & theirs, sorted(ours & theirs)


# -- the per-step path: vLLM's own _determine_batch_execution_and_padding body runs under ours.
def _stepping_runner(warmup_steps: int = 1):
    """A runner stepping the toy model with decode graphs only (mixed_graphs off; the mixed
    tests turn it on with `_mixed_graphs_on`)."""
    import dataclasses
    import types

    import torch
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from tests.graphs.test_runner import Emulated
    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner

    ns = types.SimpleNamespace
    r = _bare_runner({"model.layers.0.self_attn.attn": _kv()})
    r.moe_graphs.storage.check_devices("cpu", "cpu")
    r.uniform_decode_query_len = 1
    r.model_config = ns(is_encoder_decoder=False)
    r.input_batch.lora_id_to_lora_request = {}
    r.compilation_config.pass_config = ns(enable_sp=False)
    r.vllm_config = ns(parallel_config=ns(data_parallel_size=1, tensor_parallel_size=1),
                       observability_config=ns(cudagraph_metrics=False))
    r.parallel_config = r.vllm_config.parallel_config
    # vLLM's dispatcher with cudagraph_mode=NONE (what the take-over configures): no padding
    r.cudagraph_dispatcher = ns(dispatch=lambda num_tokens, **_: (CUDAGraphMode.NONE,
                                                                  BatchDescriptor(num_tokens)))
    r.optimistic_seq_lens_cpu = torch.zeros(8, dtype=torch.int32)
    r.model = lambda input_ids, **_: input_ids.float()[:, None] * 2  # [T, 1]
    capture = Emulated()
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, mixed_graphs=False)
    r.moe_graphs.graphs = DecodeGraphRunner(None, PluginConfig(warmup_steps=warmup_steps,
                                                               mixed_graphs=False),
                                            storage=r.moe_graphs.storage, capture_fn=capture,
                                            new_pool=object)
    return r, capture, CUDAGraphMode


@contextlib.contextmanager
def _in_step(r, num_reqs: int, query_lens: list[int], metadata: list | None = None,
             fast_inputs: bool = False, executing: bool = True):
    """execute_model's calls of one step up to the forward, inside its step scope (`executing`;
    outside: one of vLLM's dummy runs); yields (mode, descriptor, output) with the scope still
    open (what execute_model does next, e.g. compute_logits, goes in the block);
    `fast_inputs`: the plugin prepared the inputs (`DecodeInputs`)."""
    import numpy as np
    import torch

    num_tokens = sum(query_lens)
    r.optimistic_seq_lens_cpu[:num_reqs] = torch.arange(10, 10 + num_reqs)
    with r.moe_graphs.step() if executing else contextlib.nullcontext() as scope:
        if fast_inputs:
            scope.fast_inputs = True
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            num_tokens, num_reqs, np.array(query_lens, dtype=np.int32), max(query_lens), False)
        if metadata is not None:  # execute_model's next call, with the padded sizes
            metadata.append(r._build_attention_metadata(
                num_tokens, num_reqs, max(query_lens), num_tokens_padded=desc.num_tokens,
                num_reqs_padded=desc.num_reqs)[0])
        ids = torch.arange(1, desc.num_tokens + 1, dtype=torch.int32)  # vLLM slices its buffer
        out = r._model_forward(input_ids=ids, positions=ids.long())
        assert scope is None or scope.plan is None, "the forward consumes the step's plan"
        yield mode, desc, out


def _step(r, num_reqs: int, query_lens: list[int], *args, **kw):
    """`_in_step` with nothing after the forward."""
    with _in_step(r, num_reqs, query_lens, *args, **kw) as result:
        return result


class _ToyLM:
    """What GraphLogits reads of a vLLM causal LM: the LM head weight [padded vocab, hidden],
    the logits processor's vocabulary, and compute_logits (here counting its calls)."""

    def __init__(self, hidden: int = 1, vocab: int = 5, padded: int = 8) -> None:
        import types

        import torch

        self.lm_head = types.SimpleNamespace(
            weight=torch.arange(padded * hidden, dtype=torch.float32).reshape(padded, hidden))
        self.logits_processor = types.SimpleNamespace(org_vocab_size=vocab)
        self.stock_calls = 0

    def compute_logits(self, hidden):
        self.stock_calls += 1
        return (hidden @ self.lm_head.weight.t())[:, :self.logits_processor.org_vocab_size]


def test_decode_graph_paths_compute_the_logits_inside_the_forward():
    import torch

    from vllm_moe_graphs.integration.model.graph_logits import GraphLogits

    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    lm = _ToyLM()
    r.moe_graphs.logits = GraphLogits(lm, max_rows=4)
    for expected in ("warm-up", "capture", "replay", "replay"):
        with _in_step(r, 3, [1, 1, 1]) as (mode, desc, out):
            # execute_model: hidden_states[logits_indices] with DecodeInputs' slice(0, n)
            logits = lm.compute_logits(out[slice(0, 3)])
        assert torch.equal(logits, (out @ lm.lm_head.weight.t())[:, :5]), expected
        assert logits.data_ptr() == r.moe_graphs.logits.buffer.data_ptr(), expected  # the buffer
        assert lm.stock_calls == 0, expected
    assert capture.captures == 1 and r.moe_graphs.logits.handed_over == 4
    # the hand-over is taken once, for the exact view: anything else is vLLM's own path
    lm.compute_logits(out[slice(0, 3)])
    assert lm.stock_calls == 1
    with _in_step(r, 3, [1, 1, 1]) as (_, _, out):
        lm.compute_logits(out.clone())  # e.g. vLLM's index kernel's copy of the rows
    assert lm.stock_calls == 2
    with _in_step(r, 3, [1, 1, 1]) as (_, _, out):
        pass  # a step whose logits vLLM never asks for: the hand-over ends with the step
    lm.compute_logits(out[slice(0, 3)])
    assert lm.stock_calls == 3
    # a mixed batch's forward has no LM head (all its tokens' rows): vLLM computes
    with _in_step(r, 2, [5, 1]) as (_, _, out):
        lm.compute_logits(out[slice(0, 2)])
    assert lm.stock_calls == 4 and r.moe_graphs.logits.handed_over == 4
    r.moe_graphs.logits.uninstall()
    assert "compute_logits" not in vars(lm)


def test_logits_stay_with_vllm_past_the_buffer_and_on_unpadded_fallbacks(tmp_path):
    from vllm_moe_graphs.integration.model.graph_logits import GraphLogits
    from vllm_moe_graphs.killswitch import KillSwitch

    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    lm = _ToyLM()
    r.moe_graphs.logits = GraphLogits(lm, max_rows=2)
    with _in_step(r, 3, [1, 1, 1]) as (_, _, out):  # bucket 4 > 2 rows: no LM head in it
        lm.compute_logits(out[slice(0, 3)])
    assert capture.captures == 1
    assert lm.stock_calls == 1 and r.moe_graphs.logits.handed_over == 0
    with _in_step(r, 2, [1, 1]) as (_, _, out):  # bucket 2: it has
        lm.compute_logits(out[slice(0, 2)])
    assert lm.stock_calls == 1 and r.moe_graphs.logits.handed_over == 1
    kill = tmp_path / "kill"
    kill.touch()
    r.moe_graphs.graphs._kill = KillSwitch(str(kill), interval_s=0)
    with _in_step(r, 2, [1, 1]) as (mode, _, out):  # the kill switch: eager at the key's
        lm.compute_logits(out[slice(0, 2)])          # shape, the LM head still in the forward
    assert mode is mode_enum.FULL
    assert lm.stock_calls == 1 and r.moe_graphs.logits.handed_over == 2
    with _in_step(r, 2, [5, 1]) as (mode, _, out):  # a mixed batch: eager unpadded, vLLM's
        lm.compute_logits(out[slice(0, 6)])          # LM head
    assert mode is mode_enum.NONE
    assert lm.stock_calls == 2 and r.moe_graphs.logits.handed_over == 2


def test_replayed_fast_steps_build_no_attention_metadata(monkeypatch, tmp_path):
    from vllm_moe_graphs.killswitch import KillSwitch

    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    monkeypatch.setattr(GPUModelRunner, "_build_attention_metadata",
                        lambda self, *a, **kw: ("built", None))
    r.moe_graphs.lean_replay = True
    built = []
    for _ in range(4):  # warm-up, capture (both run the model), replay, replay
        _step(r, 3, [1, 1, 1], built, fast_inputs=True)
    assert built == ["built", "built", {}, {}] and capture.replays == 3
    _step(r, 2, [5, 1], built, fast_inputs=True)  # a mixed batch
    _step(r, 3, [1, 1, 1], built)  # inputs prepared by vLLM's path
    r.moe_graphs.lean_replay = False  # a builder that is not ours
    _step(r, 3, [1, 1, 1], built, fast_inputs=True)
    r.moe_graphs.lean_replay = True
    kill = tmp_path / "kill"
    kill.touch()
    r.moe_graphs.graphs._kill = KillSwitch(str(kill), interval_s=0)
    _step(r, 3, [1, 1, 1], built, fast_inputs=True)  # eager fallback
    assert built[4:] == ["built"] * 4


class _PlanRecorder:
    """Stands in for our metadata builder: records what each build was planned for."""

    def __init__(self) -> None:
        self.planned = []

    def plan_for(self, context_bucket, max_query_len=None) -> None:
        self.planned.append((context_bucket, max_query_len))


def test_plan_builders_hands_every_builder_its_keys_launch():
    """A decode key plans its context bucket, a key with prefill tokens its token bucket (the
    varlen kernel's tile), no key the step's own; every builder alike."""
    from vllm_moe_graphs.graphs.buckets import GraphKey

    builders = [_PlanRecorder(), _PlanRecorder()]
    buffers.plan_builders(builders, GraphKey(4, 256))
    buffers.plan_builders(builders, GraphKey(16, 0, 8))
    buffers.plan_builders(builders, None)
    assert [b.planned for b in builders] == [[(256, None), (None, 16), (None, None)]] * 2


def test_graph_steps_plan_attention_for_their_keys_context_bucket():
    """The step plan hands its graph key's context bucket to our metadata builders (the split
    count a key's graph is captured with), none to an eager step, and clears it after the step."""
    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    builder = _PlanRecorder()
    r.moe_graphs.metadata_builders = [builder]
    key = r.moe_graphs.graphs.decide(3, 12, True).key  # contexts 10..12
    for _ in range(3):  # warm-up, capture, replay
        _step(r, 3, [1, 1, 1])
    _step(r, 2, [5, 1])  # mixed: eager, the builder picks its own bucket
    assert builder.planned == [(key.context_bucket, None), (None, None)] * 3 + [
        (None, None)] * 2, builder.planned


def _mixed_graphs_on(r, token_buckets=(8, 16)):
    import dataclasses

    graphs = r.moe_graphs.graphs
    graphs.config = dataclasses.replace(graphs.config, mixed_graphs=True,
                                        token_buckets=token_buckets)
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, mixed_graphs=True)


def test_mixed_steps_replay_from_token_buckets_with_mixed_graphs():
    """mixed_graphs: a step with prefill tokens pads to its token bucket's key (requests padded
    to min(bucket, largest decode bucket)) as a non-uniform FULL batch, warms up, is captured and replayed like a decode key, hands
    vLLM all its real tokens' rows, and plans the varlen kernel's tile from the key."""
    from vllm_moe_graphs.capability import Reason
    from vllm_moe_graphs.graphs.buckets import GraphKey
    from vllm_moe_graphs.graphs.kinds import StepKind

    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    _mixed_graphs_on(r)
    builder = _PlanRecorder()
    r.moe_graphs.metadata_builders = [builder]
    for expected in ("warm-up", "capture", "replay"):
        mode, desc, out = _step(r, 2, [5, 1])  # 6 query tokens of 2 requests: key (8, 0, 8)
        assert mode is mode_enum.FULL, expected
        assert (desc.num_tokens, desc.num_reqs, desc.uniform) == (8, 8, False), expected
        assert out[:, 0].tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0], expected
    assert capture.captures == 1 and capture.replays == 2
    assert r.moe_graphs.graphs.keys == (GraphKey(8, 0, 8),)
    assert builder.planned == [(None, 8), (None, None)] * 3  # the key's tile, then cleared
    mode, desc, out = _step(r, 5, [3, 2, 1, 1, 1])  # another mix, same bucket: same graph
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (8, 8)
    assert out[:, 0].tolist() == [2.0 * i for i in range(1, 9)] and capture.replays == 3
    mode, desc, out = _step(r, 1, [12])  # a prompt alone: its own key (16, 0, 16), warm-up
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (16, 16)
    assert out.shape == (12, 1)
    # past the last token bucket: eager, unpadded, counted as step_too_large
    mode, desc, out = _step(r, 2, [10, 9])
    assert mode is mode_enum.NONE and desc.num_tokens == 19 and out.shape == (19, 1)
    stats = r.moe_graphs.graphs.stats
    assert stats.fallbacks == {Reason.STEP_TOO_LARGE: 1}
    # counted under the step's kind (the metrics' `kind` label)
    assert stats.replays_by_kind == {StepKind.MIXED: 3}  # the capture's replay and two more
    assert stats.fallbacks_by_kind == {(Reason.STEP_TOO_LARGE, StepKind.PREFILL): 1}
    # decode steps keep their own keys next to the mixed ones
    mode, desc, out = _step(r, 3, [1, 1, 1])
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.uniform) == (4, True)


def test_mixed_graphs_off_and_cascade_attention_run_eager():
    import numpy as np
    import torch

    from vllm_moe_graphs.capability import Reason

    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    mode, desc, out = _step(r, 2, [5, 1])  # mixed_graphs off: mixed steps eager, mixed_batch
    assert mode is mode_enum.NONE and out.shape == (6, 1)
    _mixed_graphs_on(r)
    with r.moe_graphs.step():  # vLLM chose cascade attention: eager whatever the kind
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            6, 2, np.array([5, 1], dtype=np.int32), 5, True)
        ids = torch.arange(1, 7, dtype=torch.int32)
        r._model_forward(input_ids=ids, positions=ids.long())
    assert mode is mode_enum.NONE
    assert r.moe_graphs.graphs.stats.fallbacks == {Reason.MIXED_BATCH: 1,
                                                   Reason.CASCADE_ATTENTION: 1}
    assert capture.captures == 0


def test_decode_steps_pad_to_the_bucket_warm_up_capture_replay_and_slice():
    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    # 3 decode rows -> bucket 4: padded FULL descriptor; the model sees 4 rows, vLLM gets 3
    for expected in ("warm-up", "capture", "replay", "replay"):
        mode, desc, out = _step(r, 3, [1, 1, 1])
        assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (4, 4), expected
        assert out.shape == (3, 1) and out[:, 0].tolist() == [2.0, 4.0, 6.0], expected
    assert capture.captures == 1 and capture.replays == 3  # one replay right after capture


def test_mixed_batch_runs_eager_unpadded_and_keeps_every_token():
    r, capture, mode_enum = _stepping_runner()
    mode, desc, out = _step(r, 2, [5, 1])  # a prefill chunk next to a decode row
    assert mode is mode_enum.NONE and desc.num_tokens == 6
    assert out.shape == (6, 1) and capture.captures == 0


def test_kill_switch_runs_decode_eager_at_the_keys_shape(tmp_path):
    """Under the kill switch a step that has a key runs eager at the key's padded size: the
    same kernels on the same rows as its graph, so flipping the switch changes no output."""
    from vllm_moe_graphs.killswitch import KillSwitch

    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    _step(r, 3, [1, 1, 1])  # captured
    kill = tmp_path / "kill"
    kill.touch()
    r.moe_graphs.graphs._kill = KillSwitch(str(kill), interval_s=0)
    mode, desc, out = _step(r, 3, [1, 1, 1])
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (4, 4)
    assert out.shape == (3, 1) and out[:, 0].tolist() == [2.0, 4.0, 6.0]
    assert capture.replays == 1 and r.moe_graphs.graphs.keys  # graphs kept, none replayed


def test_swapped_kv_tensor_drops_graphs_before_the_next_replay():
    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    _step(r, 3, [1, 1, 1])
    assert r.moe_graphs.graphs.keys
    r.compilation_config.static_forward_context["model.layers.0.self_attn.attn"].kv_cache = _kv()
    mode, desc, out = _step(r, 3, [1, 1, 1])
    # caught in the per-step check: graphs dropped; the bare runner has no layer registry, so
    # no fresh bind happens and the step runs eager with the storage's reason
    assert not r.moe_graphs.graphs.keys and capture.replays == 1
    assert mode is mode_enum.NONE and out.shape == (3, 1)
    assert r.moe_graphs.storage.proof().reason.value == "storage_identity_changed"


def test_dummy_runs_outside_execute_model_are_left_to_vllm():
    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    mode, desc, out = _step(r, 3, [1, 1, 1], executing=False)
    assert mode is mode_enum.NONE and desc.num_tokens == 3 and capture.captures == 0


def test_precapture_plans_each_key_at_its_context_bucket():
    """capture_model (precapture=true): vLLM's _dummy_run per key, with every row at the key's
    context bucket (the decode kernel's split count is planned from it), largest key first; each
    key captured once, then replayed by real steps without a new capture."""
    import dataclasses
    import types

    import torch

    from vllm_moe_graphs.graphs.buckets import GraphKey, graph_config
    from vllm_moe_graphs.integration.startup.precapture import PrecaptureModel

    r, capture, mode_enum = _stepping_runner(warmup_steps=3)
    r.max_model_len = 4096
    config = graph_config(
        dataclasses.replace(r.moe_graphs.graphs.config, decode_batch_buckets=(2, 4)), 4,
        r.max_model_len)
    assert config.context_buckets == (2048, 4096)
    r.moe_graphs.graphs.config = config
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, precapture=True)
    calls = []

    def dummy_run(num_tokens, **kw):  # what vLLM's _dummy_run does with the model, in short
        if not kw.get("uniform_decode"):  # the kernel warm-up's prefill batches
            return None
        calls.append((num_tokens, kw))
        assert kw["is_graph_capturing"] is False and kw["uniform_decode"] is True
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            num_tokens, num_tokens, None, 1, False)
        assert mode is mode_enum.FULL and desc.num_tokens == num_tokens  # the key's bucket
        ids = torch.arange(1, num_tokens + 1, dtype=torch.int32)
        return r.model(input_ids=ids, positions=ids.long())

    r._dummy_run = dummy_run
    r.max_num_tokens, r.input_batch.block_table = 64, types.SimpleNamespace(
        compute_slot_mapping=lambda *a: None)
    r.capture_model()
    assert [(n, kw["profile_seq_lens"]) for n, kw in calls] == [
        (4, 4096), (4, 2048), (2, 4096), (2, 2048)]
    assert all(kw["cudagraph_runtime_mode"] is mode_enum.FULL for _, kw in calls)
    assert r.moe_graphs.graphs.keys == tuple(sorted(GraphKey(b, c) for b in (2, 4)
                                                    for c in (2048, 4096)))
    assert capture.captures == 4 and not isinstance(r.model, PrecaptureModel)
    mode, desc, out = _step(r, 3, [1, 1, 1])  # contexts 10..12: key (4, 2048), no warm-up
    assert mode is mode_enum.FULL and desc.num_tokens == 4 and capture.captures == 4
    assert out[:, 0].tolist() == [2.0, 4.0, 6.0]


def _mixed_precapture_runner():
    """The stepping runner with token buckets 8 and 16 and decode buckets 2 and 4 at one context
    bucket (2048), vLLM's _dummy_run stood in: each FULL run (a capture) is recorded in `calls`
    as (tokens, uniform, profile_seq_lens), then as the padded step it was planned as (tokens,
    requests, uniform); eager runs (the kernel warm-up) do nothing. Returns (runner, capture,
    CUDAGraphMode, plan recorder, calls)."""
    import dataclasses
    import types

    import torch

    r, capture, mode_enum = _stepping_runner(warmup_steps=3)
    _mixed_graphs_on(r, token_buckets=(8, 16))
    graphs = r.moe_graphs.graphs
    graphs.config = dataclasses.replace(graphs.config, decode_batch_buckets=(2, 4),
                                        context_buckets=(2048,))
    builder = _PlanRecorder()
    r.moe_graphs.metadata_builders = [builder]
    calls = []

    def dummy_run(num_tokens, **kw):
        if kw.get("cudagraph_runtime_mode") is not mode_enum.FULL:
            return None  # the kernel warm-up's eager batches
        calls.append((num_tokens, kw["uniform_decode"], kw["profile_seq_lens"]))
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            num_tokens, num_tokens, None, 1, False)
        assert mode is mode_enum.FULL
        calls.append((desc.num_tokens, desc.num_reqs, desc.uniform))
        ids = torch.arange(1, desc.num_tokens + 1, dtype=torch.int32)
        return r.model(input_ids=ids, positions=ids.long())

    r._dummy_run = dummy_run
    r.max_model_len = 2048
    r.max_num_tokens, r.input_batch.block_table = 16, types.SimpleNamespace(
        compute_slot_mapping=lambda *a: None)
    return r, capture, mode_enum, builder, calls


# key (16, 0, 4) from 4 one-token requests padded to 16 tokens, then (8, 0, 4), then the decode
# keys (4 and 2 rows at the 2048 context bucket)
PRECAPTURE_CALLS = [(4, False, 1), (16, 4, False), (4, False, 1), (8, 4, False),
                    (4, True, 2048), (4, 4, True), (2, True, 2048), (2, 2, True)]


def test_precapture_captures_every_token_bucket_with_mixed_graphs():
    """precapture with mixed_graphs: before the decode keys, one key per token bucket, largest
    first, each from vLLM's _dummy_run of one-token requests (as many as the key's padded
    requests) that the plan pads to the key's tokens as a non-uniform FULL batch, the varlen
    kernel's tile planned from the bucket; a real mixed step then replays without capture."""
    import dataclasses

    from vllm_moe_graphs.graphs.buckets import GraphKey
    from vllm_moe_graphs.graphs.kinds import StepKind

    r, capture, mode_enum, builder, calls = _mixed_precapture_runner()
    graphs = r.moe_graphs.graphs
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, precapture=True)
    r.capture_model()
    assert calls == PRECAPTURE_CALLS
    assert (None, 16) in builder.planned and (None, 8) in builder.planned
    assert set(graphs.keys) == {GraphKey(16, 0, 4), GraphKey(8, 0, 4), GraphKey(4, 2048),
                                GraphKey(2, 2048)}
    assert graphs.stats.captures_by_kind == {StepKind.MIXED: 2, StepKind.DECODE: 2}
    mode, desc, out = _step(r, 2, [5, 1])  # 6 tokens of 2 requests: key (8, 0, 4), replayed
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (8, 4)
    assert capture.captures == 4 and capture.replays >= 1
    assert out[:, 0].tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]


def test_idle_capture_takes_one_key_per_call_in_precapture_order(caplog):
    """idle_capture: each call of the worker's RPC (the engine core's idle hook) makes the next
    dummy run precapture would and captures that key, and says whether a key is left; the
    call that captures the last key logs that idle capture is done, once; the keys then
    replay real steps; a key with a graph is not captured again."""
    import dataclasses
    import logging
    import types

    from vllm_moe_graphs.integration.worker import MoeGraphsWorker

    r, capture, mode_enum, _, calls = _mixed_precapture_runner()
    worker = types.SimpleNamespace(model_runner=r)
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, idle_capture=False)
    assert not MoeGraphsWorker.moe_graphs_idle_capture(worker), "idle_capture off: nothing"
    assert capture.captures == 0
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, idle_capture=True)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        answers = [MoeGraphsWorker.moe_graphs_idle_capture(worker) for _ in range(5)]
    assert answers == [True, True, True, False, False], answers
    done = [m.getMessage() for m in caplog.records if "idle capture done" in m.getMessage()]
    assert done == ["moe_graphs: idle capture done: no key left to capture (4 graphs, 0 "
                    "quarantined, 0 denied now, pool 4 MiB)"], done
    assert calls == PRECAPTURE_CALLS and capture.captures == 4
    mode, desc, out = _step(r, 3, [1, 1, 1])  # a decode step of 3: key (4, 2048), no capture
    assert mode is mode_enum.FULL and desc.num_tokens == 4 and capture.captures == 4
    assert out[:, 0].tolist() == [2.0, 4.0, 6.0]


def test_idle_capture_says_it_is_done_when_every_key_is_denied(caplog, tmp_path):
    """With the kill file present from the start no key may be captured: the first idle call
    says idle capture is done (every key denied), once; with the file removed the next calls
    capture every key and say so again (what a benchmark waiting for the line needs)."""
    import dataclasses
    import logging
    import types

    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner
    from vllm_moe_graphs.integration.worker import MoeGraphsWorker
    from vllm_moe_graphs.killswitch import KillSwitch

    r, capture, _, _, _ = _mixed_precapture_runner()
    kill = tmp_path / "kill"
    kill.touch()
    r.moe_graphs.graphs = DecodeGraphRunner(
        None, r.moe_graphs.graphs.config, storage=r.moe_graphs.storage, capture_fn=capture,
        new_pool=object, kill_switch=KillSwitch(str(kill), interval_s=0))
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, idle_capture=True)
    worker = types.SimpleNamespace(model_runner=r)

    def done_lines() -> list[str]:
        return [m.getMessage().split("(")[1] for m in caplog.records
                if "idle capture done" in m.getMessage()]

    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        answers = [MoeGraphsWorker.moe_graphs_idle_capture(worker) for _ in range(3)]
        assert answers == [False] * 3 and capture.captures == 0
        assert done_lines() == ["0 graphs, 0 quarantined, 4 denied now, pool 0 MiB)"]
        kill.unlink()
        answers = [MoeGraphsWorker.moe_graphs_idle_capture(worker) for _ in range(5)]
    assert answers == [True, True, True, False, False] and capture.captures == 4
    assert done_lines()[1:] == ["4 graphs, 0 quarantined, 0 denied now, pool 4 MiB)"]


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


def test_graph_config_fits_buckets_to_the_engine():
    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.graphs.buckets import graph_config

    cfg = PluginConfig(decode_batch_buckets=(1, 8, 64, 256),
                       context_buckets=(2048, 8192, 32768, 131072))
    fitted = graph_config(cfg, 64, 40960)
    assert fitted.decode_batch_buckets == (1, 8, 64)
    assert fitted.context_buckets == (2048, 8192, 32768, 40960)
    small = graph_config(cfg, 48, 512)
    assert small.decode_batch_buckets == (1, 8, 48) and small.context_buckets == (512,)
    assert graph_config(cfg, 512, 131072) == cfg
    # a largest context bucket below max_model_len is the operator's limit: longer runs eager
    short = PluginConfig(context_buckets=(2048, 8192))
    assert graph_config(short, 256, 40960).context_buckets == (2048, 8192)


def test_worker_freezes_the_import_heap_before_the_device_exists():
    import gc

    class _Probe(_CpuDeviceConfig):
        @property
        def device_type(self) -> str:
            self.frozen = gc.get_freeze_count()
            return "cpu"

    w = MoeGraphsWorker.__new__(MoeGraphsWorker)
    w.device_config = _Probe()
    w.use_v2_model_runner = False
    gc.unfreeze()
    try:
        with pytest.raises(RuntimeError, match="Unsupported device type"):
            w.init_device()
        # vLLM's init_device (reading the device type first) ran on a frozen heap.
        assert w.device_config.frozen > 1000
    finally:
        gc.unfreeze()
    w.use_v2_model_runner = True  # the V2 runner is left alone: no freeze either
    with pytest.raises(RuntimeError, match="Unsupported device type"):
        w.init_device()
    assert w.device_config.frozen == 0
