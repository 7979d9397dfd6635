"""The modes compared by `benchmarks.decode`, and the `vllm.LLM` keyword arguments of each.

Every mode shares the same engine settings (`common_llm_kwargs`): dummy weights, no tokenizer,
one max_num_seqs and max_model_len, no prefix caching, one seed. A mode only adds what makes it
that mode. Stock modes run with `VLLM_PLUGINS=` (empty), so no installed plugin, ours included,
touches them, and with vLLM's own choice of attention backend (FLASH_ATTN, FlashAttention 3, on
the H200), as every user's vLLM runs; the `_triton` stock modes name TRITON_ATTN instead.

Plugin modes are enabled by the plugin package itself: they are available once
`vllm_moe_graphs` exposes `benchmark_llm_kwargs(mode: str) -> dict` (the feature flag: it
exists only when the decode-graph runner does). The dict holds the extra `vllm.LLM` kwargs of
that mode (e.g. `additional_config`, `compilation_config`) and must be JSON-serialisable; raising
`NotImplementedError("why")` reports the mode absent with that reason.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
from collections.abc import Mapping
from typing import Any

PLUGIN_PACKAGE = "vllm_moe_graphs"
PLUGIN_HOOK = "benchmark_llm_kwargs"
TRITON = {"attention_config": {"backend": "TRITON_ATTN"}}


class Family(str, enum.Enum):
    STOCK = "stock"
    PLUGIN = "plugin"


class AbsentReason(str, enum.Enum):
    NOT_IMPLEMENTED = "not implemented yet"
    NOT_IMPORTABLE = "plugin package not importable"
    DECLINED = "plugin declined the mode"
    BAD_HOOK = "plugin hook returned an unusable value"


@dataclasses.dataclass(frozen=True, slots=True)
class Availability:
    ok: bool
    reason: AbsentReason | None = None
    detail: str = ""

    def text(self) -> str:
        if self.ok:
            return "available"
        assert self.reason is not None, "an unavailable mode needs a reason"
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


@dataclasses.dataclass(frozen=True, slots=True)
class Mode:
    name: str
    family: Family
    graphs: bool  # does the mode decode through CUDA graphs?
    description: str
    extra_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    startup_estimate_s: float = 60.0  # rough, for --time-budget-s planning only
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # extra worker environment
    diagnostic: bool = False  # a variant for finding where time goes; never a reference mode

    def budget_weight(self, presets: int = 1) -> float:
        """Relative share of a time budget: start-up plus measuring every point under `presets`
        sampling presets (eager steps cost ~10x)."""
        return self.startup_estimate_s + presets * (40.0 if self.graphs else 120.0)

    def available(self) -> Availability:
        if self.family is Family.STOCK:
            return Availability(ok=True)
        return _plugin_kwargs(self.name)[0]

    def llm_kwargs(self, common: Mapping[str, Any]) -> dict[str, Any]:
        """`common` plus this mode's kwargs; nested config dicts are merged key by key."""
        if self.family is Family.STOCK:
            extra: Mapping[str, Any] = self.extra_kwargs
        else:
            availability, hook_kwargs = _plugin_kwargs(self.name)
            if not availability.ok or hook_kwargs is None:
                raise NotImplementedError(f"mode {self.name} is absent: {availability.text()}")
            extra = hook_kwargs
        return merge_kwargs(common, extra)

    def worker_env(self) -> dict[str, str]:
        """Environment of this mode's worker process (set before vLLM is imported)."""
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # engine in-process: we drive its steps
        if self.family is Family.STOCK:
            env["VLLM_PLUGINS"] = ""  # load no general plugin: stock means stock
        env.update(self.env)
        return env


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode(
            "stock_eager",
            Family.STOCK,
            False,
            "vLLM with enforce_eager=True: no torch.compile, no CUDA graphs",
            {"enforce_eager": True},
            startup_estimate_s=35.0,
        ),
        Mode(
            "stock_graphs",
            Family.STOCK,
            True,
            "vLLM 0.26 default: torch.compile (VLLM_COMPILE) + cudagraph_mode FULL_AND_PIECEWISE",
            {},
            startup_estimate_s=90.0,
        ),
        Mode(
            "stock_full_decode",
            Family.STOCK,
            True,
            "torch.compile (VLLM_COMPILE) + cudagraph_mode FULL_DECODE_ONLY",
            {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
            startup_estimate_s=80.0,
        ),
        Mode(
            "stock_full_decode_nc",
            Family.STOCK,
            True,
            "no torch.compile (compilation mode NONE) + cudagraph_mode FULL_DECODE_ONLY",
            {"compilation_config": {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}},
            startup_estimate_s=35.0,
        ),
        Mode(
            "stock_graphs_triton",
            Family.STOCK,
            True,
            "stock_graphs with TRITON_ATTN (vLLM's Triton attention backend)",
            {**TRITON},
            startup_estimate_s=90.0,
        ),
        Mode(
            "stock_full_decode_nc_triton",
            Family.STOCK,
            True,
            "stock_full_decode_nc with TRITON_ATTN (vLLM's Triton attention backend)",
            {"compilation_config": {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"},
             **TRITON},
            startup_estimate_s=35.0,
        ),
        Mode(
            "stock_full_decode_nc_v1",
            Family.STOCK,
            True,
            "diagnostic: stock_full_decode_nc on vLLM's V1 model runner (the one the plugin "
            "extends), VLLM_USE_V2_MODEL_RUNNER=0: separates runner overhead from the plugin's",
            {"compilation_config": {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}},
            startup_estimate_s=35.0,
            env={"VLLM_USE_V2_MODEL_RUNNER": "0"},
            diagnostic=True,
        ),
        Mode(
            "plugin_eager",
            Family.PLUGIN,
            False,
            "vllm_moe_graphs loaded, its decode graphs off (kwargs from the plugin's hook)",
            startup_estimate_s=35.0,
        ),
        Mode(
            "plugin_graphs",
            Family.PLUGIN,
            True,
            "vllm_moe_graphs CUDA graphs, its defaults: decode, prefill and mixed steps graphed "
            "(kwargs from the plugin's hook)",
            startup_estimate_s=45.0,
        ),
        Mode(
            "plugin_graphs_experimental",
            Family.PLUGIN,
            True,
            "plugin_graphs with small_m_gemm on every eligible linear layer (default: auto, "
            "o_proj/down_proj only) and fuse_qk_norm_rope on (on request)",
            startup_estimate_s=45.0,
            diagnostic=True,
        ),
        Mode(
            "plugin_graphs_decode_only",
            Family.PLUGIN,
            True,
            "plugin_graphs with mixed_graphs off: steps with prefill tokens eager, only pure "
            "decode graphed (on request)",
            startup_estimate_s=45.0,
            diagnostic=True,
        ),
        Mode(
            "plugin_graphs_moe_padding",
            Family.PLUGIN,
            True,
            "plugin_graphs with skip_moe_padding off: the padding rows of a padded step "
            "routed through the MoE experts, as stock vLLM does (on request)",
            startup_estimate_s=45.0,
            diagnostic=True,
        ),
        Mode(
            "plugin_graphs_fused_router",
            Family.PLUGIN,
            True,
            "plugin_graphs with fuse_moe_padding_mask: the padding rows' expert ids written by "
            "the plugin's routing kernel, no mask launch per MoE layer (on request)",
            startup_estimate_s=45.0,
            diagnostic=True,
        ),
        Mode(
            "plugin_graphs_serial_warm_up",
            Family.PLUGIN,
            True,
            "plugin_graphs with warm_up_compile_threads 0: the start-up warm-up's fused-MoE "
            "kernel variants compiled one after the other (on request; for the start-up "
            "benchmark)",
            startup_estimate_s=45.0,
            diagnostic=True,
        ),
        Mode(
            "plugin_graphs_compiled_numerics",
            Family.PLUGIN,
            True,
            "plugin_graphs with compiled_numerics: RMSNorm and SiLU-and-mul rounded as stock's "
            "compiled model, by the plugin's Triton kernels (on request)",
            startup_estimate_s=45.0,
            diagnostic=True,
        ),
        Mode(
            "plugin_graphs_sample_in_graph",
            Family.PLUGIN,
            True,
            "plugin_graphs with sample_in_graph: a sampled batch's tokens drawn by the "
            "plugin's sampler graph instead of vLLM's eager sampler (on request)",
            startup_estimate_s=45.0,
            diagnostic=True,
        ),
        Mode(
            "plugin_graphs_cublas",
            Family.PLUGIN,
            True,
            "diagnostic: plugin_graphs with vLLM's kernels around attention (small_m_gemm and "
            "fuse_qk_norm_rope off): separates the graph runner from those kernels",
            startup_estimate_s=45.0,
            diagnostic=True,
        ),
        Mode(
            "plugin_backend_vllm_graphs",
            Family.PLUGIN,
            True,
            "diagnostic: the plugin's attention backend inside vLLM's own FULL decode graphs on "
            "the V1 runner (plugin graph runner off): separates the backend from the runner",
            startup_estimate_s=35.0,
            env={"VLLM_USE_V2_MODEL_RUNNER": "0"},
            diagnostic=True,
        ),
    )
}
STOCK_GRAPH_MODES = tuple(
    n for n, m in MODES.items() if m.family is Family.STOCK and m.graphs and not m.diagnostic
)
EAGER_MODES = tuple(n for n, m in MODES.items() if not m.graphs)
GRAPH_MODES = tuple(n for n, m in MODES.items() if m.graphs)
DEFAULT_MODES = tuple(n for n, m in MODES.items() if not m.diagnostic)  # what a plain run runs


def parse_modes(names: list[str]) -> list[Mode]:
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    return [MODES[n] for n in dict.fromkeys(names)]


def common_llm_kwargs(
    *,
    config_dir: str,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    seed: int,
) -> dict[str, Any]:
    """The `vllm.LLM` kwargs every mode shares."""
    return {
        "model": config_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": seed,
        "tensor_parallel_size": 1,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "enable_prefix_caching": False,
        "gpu_memory_utilization": gpu_memory_utilization,
    }


def merge_kwargs(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _plugin_kwargs(mode: str) -> tuple[Availability, dict[str, Any] | None]:
    """Ask the plugin package for `mode`'s kwargs; never invents them."""
    try:
        pkg = importlib.import_module(PLUGIN_PACKAGE)
    except Exception as exc:  # noqa: BLE001 - any import failure makes the mode absent
        return Availability(
            False, AbsentReason.NOT_IMPORTABLE, f"{type(exc).__name__}: {exc}"
        ), None
    hook = getattr(pkg, PLUGIN_HOOK, None)
    if not callable(hook):
        detail = f"{PLUGIN_PACKAGE}.{PLUGIN_HOOK}() does not exist yet"
        return Availability(False, AbsentReason.NOT_IMPLEMENTED, detail), None
    try:
        kwargs = hook(mode)
    except NotImplementedError as exc:
        return Availability(False, AbsentReason.DECLINED, str(exc) or "NotImplementedError"), None
    if not isinstance(kwargs, Mapping):
        detail = f"{PLUGIN_HOOK}({mode!r}) returned {type(kwargs).__name__}, expected a dict"
        return Availability(False, AbsentReason.BAD_HOOK, detail), None
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as exc:
        return Availability(False, AbsentReason.BAD_HOOK, f"not JSON-serialisable: {exc}"), None
    return Availability(True), dict(kwargs)
