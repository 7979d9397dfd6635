"""The V1 runner/worker override points against the installed vLLM 0.26.0 (CPU only)."""

from __future__ import annotations

import inspect
import re

import pytest

gpu_model_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
GPUModelRunner = gpu_model_runner.GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from vllm_moe_graphs.integration import model_runner, worker  # noqa: E402
from vllm_moe_graphs.integration.model_runner import (  # noqa: E402
    CALLED,
    OVERRIDES,
    MoeGraphsModelRunner,
    check_override_points,
)
from vllm_moe_graphs.integration.signatures import IncompatibleVllmError  # noqa: E402
from vllm_moe_graphs.integration.worker import (  # noqa: E402
    MoeGraphsWorker,
    check_worker_points,
    runner_class_substituted,
)

_ROW = re.compile(r"^`(\w+)`\s*\|([^|]*)\|", re.MULTILINE)


def test_modules_import_on_cpu_and_subclass_vllm():
    assert issubclass(MoeGraphsModelRunner, GPUModelRunner)
    assert issubclass(MoeGraphsWorker, Worker)
    assert MoeGraphsWorker.runner_cls is MoeGraphsModelRunner


def test_override_points_match_installed_vllm():
    check_override_points()
    check_worker_points()


def test_drifted_runner_signature_is_named():
    class DriftedRunner(GPUModelRunner):
        def initialize_kv_cache(self, kv_cache_config):  # lost is_profiling
            raise AssertionError("never called")

    with pytest.raises(IncompatibleVllmError, match=r"DriftedRunner\.initialize_kv_cache") as e:
        check_override_points(DriftedRunner)
    assert "'is_profiling'" in str(e.value)  # expected vs found


def test_missing_called_method_is_named():
    class NoGetModel:  # a runner base without get_model, everything else like 0.26
        pass

    for name, params in OVERRIDES.items():
        setattr(NoGetModel, name, _fn_with(params))
    with pytest.raises(IncompatibleVllmError, match=r"NoGetModel\.get_model.*does not exist"):
        check_override_points(NoGetModel)


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
    assert table == {name: params[1:] for name, params in OVERRIDES.items()}

    own = {n for n, v in MoeGraphsModelRunner.__dict__.items() if inspect.isfunction(v)}
    overridden = {n for n in own if hasattr(GPUModelRunner, n)}
    assert overridden == set(OVERRIDES)
    helpers = own - overridden
    assert all(n.startswith("_mg_") for n in helpers), helpers
    assert not set(CALLED) & own

    for name, params in OVERRIDES.items():  # same parameters and defaults as vLLM's
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
        with runner_class_substituted(_RaisingRunner):
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GPUModelRunnerV1

            assert GPUModelRunnerV1 is _RaisingRunner
            GPUModelRunnerV1(None, None)
    assert gpu_model_runner.GPUModelRunner is GPUModelRunner


def test_substitution_refuses_a_non_subclass():
    with pytest.raises(TypeError, match="must subclass"):
        with runner_class_substituted(int):
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
    from vllm_moe_graphs.kv.storage import PagedKVStorage, Phase

    import torch

    ns = types.SimpleNamespace
    r = MoeGraphsModelRunner.__new__(MoeGraphsModelRunner)
    r.moe_config = PluginConfig()
    r.moe_storage = PagedKVStorage()
    r._mg_layers = None
    r._mg_graphs = None
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
    r.moe_storage.bind(layers, phase=Phase.SERVING, buffers=r._mg_buffers())
    r._mg_kv_watch = tuple((ctx[n], t) for n, t in layers.items())
    return r


def test_cleanup_unbinds_before_vllm_frees_the_cache():
    r = _bare_runner({"model.layers.0.self_attn.attn": _kv()})
    # vLLM's body starts with torch.accelerator.synchronize(): raises without a GPU, which
    # shows our unbind ran before super() (and before vLLM dropped its references).
    try:
        r._cleanup_profiling_kv_cache()
    except RuntimeError:
        assert len(r.kv_caches) == 1, "vLLM's body ran: this host has an accelerator"
    assert not r.moe_storage.bound
    assert r.moe_storage.proof().reason.value == "storage_unbound"


def test_wake_up_revalidates_the_bound_identity():
    name = "model.layers.0.self_attn.attn"
    r = _bare_runner({name: _kv()})
    gen = r.moe_storage.generation
    r.post_kv_cache_wake_up()  # vLLM's body: no-op for an unquantized cache
    assert r.moe_storage.bound and r.moe_storage.generation == gen

    r.compilation_config.static_forward_context[name].kv_cache = _kv(8)  # reallocated
    r.post_kv_cache_wake_up()
    proof = r.moe_storage.proof()
    assert proof.reason.value == "storage_identity_changed"
    assert "shape" in proof.detail and name in proof.detail


def test_wake_up_notices_a_moved_input_buffer():
    import torch

    r = _bare_runner({"model.layers.0.self_attn.attn": _kv()})
    r.positions = torch.zeros(8, dtype=torch.int64)  # vLLM reallocated a persistent buffer
    r.post_kv_cache_wake_up()
    proof = r.moe_storage.proof()
    assert proof.reason.value == "storage_identity_changed" and "positions" in proof.detail


def test_a_swapped_layer_tensor_is_seen_by_the_per_step_check():
    name = "model.layers.0.self_attn.attn"
    r = _bare_runner({name: _kv()})
    assert not r._mg_kv_rebound()
    r.compilation_config.static_forward_context[name].kv_cache = _kv()  # same shape, new tensor
    assert r._mg_kv_rebound()
    r._mg_rebind("test swap")
    assert r.moe_storage.proof().reason.value == "storage_identity_changed"


def test_our_runner_attributes_do_not_collide_with_vllm():
    # vLLM's runner has its own `_moe_*` attributes (e.g. `_moe_model` for EPLB); every name our
    # subclass assigns or defines must be one vLLM's GPUModelRunner never uses.
    ours_src = inspect.getsource(MoeGraphsModelRunner)
    ours = set(re.findall(r"self\.(\w+)\s*(?::[^=]+)?=[^=]", ours_src))
    ours |= {n for n in MoeGraphsModelRunner.__dict__ if not n.startswith("__")}
    ours -= set(OVERRIDES) | set(CALLED) | {"model"}  # `model` is swapped on purpose (precapture)
    theirs = set(re.findall(r"self\.(\w+)", inspect.getsource(gpu_model_runner)))
    assert ours and not ours & theirs, sorted(ours & theirs)
