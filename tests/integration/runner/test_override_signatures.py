"""The V1 runner/worker override points against the installed vLLM 0.26.0 (CPU only): signatures,
the docstring table, drift detection, the runner-class substitution and the worker's device
start-up."""

from __future__ import annotations

import inspect
import re

import pytest

gpu_model_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
GPUModelRunner = gpu_model_runner.GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from vllm_moe_graphs.integration import worker  # noqa: E402
from vllm_moe_graphs.integration.runner import model_runner  # noqa: E402
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


def test_our_runner_attributes_do_not_collide_with_vllm():
    # vLLM's runner has its own `_moe_*` attributes (e.g. `_moe_model` for EPLB); every name our
    # subclass assigns or defines must be one vLLM's GPUModelRunner never uses.
    ours_src = inspect.getsource(MoeGraphsModelRunner)
    ours = set(re.findall(r"self\.(\w+)\s*(?::[^=]+)?=[^=]", ours_src))
    ours |= {n for n in MoeGraphsModelRunner.__dict__ if not n.startswith("__")}
    ours -= set(RUNNER_OVERRIDES) | set(RUNNER_CALLED) | {"model"}  # `model` is swapped on purpose (precapture)
    theirs = set(re.findall(r"self\.(\w+)", inspect.getsource(gpu_model_runner)))
    assert ours and not ours & theirs, sorted(ours & theirs)


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
