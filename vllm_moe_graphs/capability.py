"""Capability model: may this engine replay decode CUDA graphs, and if not, why not.

Capability is data, not a bool: a frozen `DecodeGraphCapability` composed from independent
`Proof`s, each carrying a `Reason` from a fixed set. Anything unknown or unproven is a deny.
Per-batch fallbacks use the same `Reason`s, and metrics labels come only from this enum.

Config-time proofs are computed from `ConfigFacts`, a plain description of the engine settings
that the integration layer fills from a vLLM `VllmConfig` (or, in `moe-graphs doctor`, from
engine arguments and the model's `config.json`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable


class Reason(str, enum.Enum):
    """Why decode graphs run or not. The value is the metrics label and the doctor's word."""

    ELIGIBLE = "eligible"
    # config time
    DISABLED_BY_ENV = "disabled_by_env"
    DISABLED_BY_CONFIG = "disabled_by_config"
    NO_CUDA = "no_cuda"
    UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
    MLA_LAYOUT_UNSUPPORTED = "mla_layout_unsupported"
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    ENFORCE_EAGER = "enforce_eager"
    PIPELINE_PARALLEL = "pipeline_parallel"
    TENSOR_PARALLEL = "tensor_parallel"
    SPECULATIVE_DECODING = "speculative_decoding"
    LORA = "lora"
    OFFLOAD_NOT_GRAPH_SAFE = "offload_not_graph_safe"
    UNSUPPORTED_QUANTIZATION = "unsupported_quantization"
    FP8_PER_TENSOR_MOE = "fp8_per_tensor_moe"
    FP8_UNPROVEN_KERNELS = "fp8_unproven_kernels"
    SLIDING_WINDOW = "sliding_window"
    POOLING_RUNNER = "pooling_runner"
    DATA_PARALLEL = "data_parallel"
    USER_COMPILATION = "user_compilation"
    # runtime (storage adapter, runner)
    STORAGE_UNBOUND = "storage_unbound"
    STORAGE_IDENTITY_CHANGED = "storage_identity_changed"
    DEVICE_MISMATCH = "device_mismatch"
    UNPROVEN = "unproven"
    # per batch
    KILL_SWITCH = "kill_switch"
    MIXED_BATCH = "mixed_batch"
    STEP_TOO_LARGE = "step_too_large"
    CASCADE_ATTENTION = "cascade_attention"
    BATCH_TOO_LARGE = "batch_too_large"
    CONTEXT_TOO_LONG = "context_too_long"
    CAPTURE_FAILED = "capture_failed"
    MEMORY_BUDGET = "memory_budget"
    RANK_DISAGREEMENT = "rank_disagreement"


REMEDY: dict[Reason, str] = {
    Reason.ELIGIBLE: "nothing to do: decode steps replay CUDA graphs",
    Reason.DISABLED_BY_ENV: "unset MOE_GRAPHS_DISABLE (or set it to 0) to enable the plugin",
    Reason.DISABLED_BY_CONFIG: 'set "enabled": true in --additional-config \'{"moe_graphs": {...}}\'',
    Reason.NO_CUDA: "run on an NVIDIA GPU with CUDA; CPU and other platforms run stock vLLM",
    Reason.UNSUPPORTED_ARCHITECTURE: "only Qwen3ForCausalLM and Qwen3MoeForCausalLM are supported; "
    "other models run stock vLLM",
    Reason.MLA_LAYOUT_UNSUPPORTED: "MLA models (DeepSeek V2/V3) use a latent KV layout the plugin "
    "does not own; they run stock vLLM",
    Reason.UNSUPPORTED_DTYPE: "use --dtype bfloat16 or float16 and an unquantized KV cache "
    "(--kv-cache-dtype auto, without --calculate-kv-scales)",
    Reason.ENFORCE_EAGER: "drop --enforce-eager to allow the plugin's CUDA graphs",
    Reason.PIPELINE_PARALLEL: "use --pipeline-parallel-size 1",
    Reason.TENSOR_PARALLEL: "use --tensor-parallel-size 1; the plugin's graphs with tensor "
    "parallelism are not supported yet (stock vLLM runs)",
    Reason.SPECULATIVE_DECODING: "drop --speculative-config; speculative decoding runs stock vLLM",
    Reason.LORA: "drop --enable-lora; LoRA runs stock vLLM",
    Reason.OFFLOAD_NOT_GRAPH_SAFE: "use UVA offload (--cpu-offload-gb N, pinned memory, "
    "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA unset) or no offload",
    Reason.UNSUPPORTED_QUANTIZATION: "quantized weights are not proven under the plugin's graphs "
    "yet: stock vLLM serves them with its own graphs; serve a bfloat16 / float16 checkpoint "
    "without --quantization to use the plugin",
    Reason.FP8_PER_TENSOR_MOE: "stock vLLM serves it with its own graphs; the plugin can only "
    "ever graph row-independent FP8: block-quantized weights (a checkpoint whose "
    "quantization_config has weight_block_size [128, 128], e.g. Qwen/Qwen3-30B-A3B-FP8, or "
    "--quantization fp8_per_block on a bf16 checkpoint), whose activations are quantized per "
    "token and 128-column group (not proven yet either: unsupported_quantization)",
    Reason.FP8_UNPROVEN_KERNELS: "set VLLM_USE_DEEP_GEMM=0 (and leave --moe-backend auto): "
    "vLLM then runs block FP8 on its CUTLASS GEMM and Triton experts, the kernels the plugin's "
    "proofs ran on; with DeepGEMM, FlashInfer or Marlin stock vLLM serves it",
    Reason.SLIDING_WINDOW: "pass --disable-sliding-window (vLLM then caps --max-model-len at the "
    "window) to use the plugin; with the window on, stock vLLM runs",
    Reason.POOLING_RUNNER: "the plugin graphs text generation only; pooling models (--runner "
    "pooling, --convert embed/classify, sentence-transformers checkpoints) run stock vLLM",
    Reason.DATA_PARALLEL: "use --data-parallel-size 1 with an MoE model (its ranks pad and sync "
    "every step together, which the plugin's graphs do not follow yet); stock vLLM runs",
    Reason.USER_COMPILATION: "stock vLLM runs the compilation you asked for; drop -O<n> and the "
    "--compilation-config mode / cudagraph_mode (or set both to NONE) to use the plugin's graphs",
    Reason.STORAGE_UNBOUND: "the KV storage adapter is not bound yet: graphs start after the KV "
    "cache is allocated; if this persists, report it",
    Reason.STORAGE_IDENTITY_CHANGED: "the KV cache moved (sleep/wake, reload): graphs are "
    "recaptured after the next bind; nothing to do",
    Reason.DEVICE_MISMATCH: "model, KV cache and runner must be on the same GPU",
    Reason.UNPROVEN: "a safety proof was never supplied; this is a plugin bug, please report it",
    Reason.KILL_SWITCH: "remove the file named by MOE_GRAPHS_KILL_FILE to resume graph replay",
    Reason.MIXED_BATCH: "steps with prefill tokens run eager because mixed_graphs is false; "
    "set it true (the default) to graph them",
    Reason.STEP_TOO_LARGE: "raise the largest token_buckets entry to cover this step's query "
    "tokens (mixed_graphs)",
    Reason.CASCADE_ATTENTION: "vLLM chose cascade attention for a long shared prefix; such steps "
    "run eager; nothing to do",
    Reason.BATCH_TOO_LARGE: "raise the largest decode_batch_buckets entry to cover this batch",
    Reason.CONTEXT_TOO_LONG: "raise the largest context_buckets entry to cover this context",
    Reason.CAPTURE_FAILED: "see the log for the capture error; the key stays quarantined and runs "
    "eager",
    Reason.MEMORY_BUDGET: "raise graph_memory_budget_mib or use fewer buckets",
    Reason.RANK_DISAGREEMENT: "tensor-parallel ranks decided differently for this step (e.g. the "
    "kill file seen by one rank first, a key quarantined on one rank): every rank ran it eager; "
    "a steady count points to one rank's log",
}
assert set(REMEDY) == set(Reason), "every Reason needs a remedy"

SUPPORTED_ARCHITECTURES = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
MLA_ARCHITECTURES = frozenset(
    {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
     "DeepseekForCausalLM", "KimiK2ForCausalLM"}
)
SUPPORTED_DTYPES = frozenset({"bfloat16", "float16"})
SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 128)  # what the attention kernels are built for
GRAPH_SAFE_OFFLOAD = frozenset({"none", "uva"})


class Fp8Scheme(str, enum.Enum):
    """How FP8 weights and the activations they meet are quantized. It decides whether a real row
    of a padded step can depend on the step's other rows (padding rows included)."""

    # 128x128 weight blocks, activations quantized per token and 128-column group: row by row
    BLOCK = "block"
    # per-tensor weights, dynamic activation scales: the fused MoE takes one over all rows
    PER_TENSOR = "per_tensor"
    # per-tensor weights, activation scales fixed by the checkpoint (activation_scheme static)
    STATIC = "static"
    # per-output-channel weights, activations quantized per token
    PER_CHANNEL = "per_channel"


FP8_SCHEME_TEXT: dict[Fp8Scheme, str] = {
    Fp8Scheme.BLOCK: "block-quantized FP8, 128x128 weight blocks, activations quantized per "
    "token and 128-column group",
    Fp8Scheme.PER_TENSOR: "per-tensor FP8, dynamic activation scales",
    Fp8Scheme.STATIC: "per-tensor FP8, static activation scales from the checkpoint",
    Fp8Scheme.PER_CHANNEL: "per-channel FP8, activations quantized per token",
}


@dataclasses.dataclass(frozen=True)
class WeightQuantization:
    """The weights' quantization: vLLM's method name and, for FP8, its scheme."""

    method: str  # vLLM's name: "fp8", "fp8_per_block", "awq", "compressed-tensors", ...
    fp8_scheme: Fp8Scheme | None = None  # None: not FP8, or a scheme not recognised

    def __str__(self) -> str:
        if self.fp8_scheme is None:
            return self.method
        return f"{self.method}: {FP8_SCHEME_TEXT[self.fp8_scheme]}"


# Weight quantizations proven by a GPU parity test against stock vLLM; every other one is
# denied (`unsupported_quantization`, or `fp8_per_tensor_moe`, which no proof can lift) and runs
# stock vLLM.
PROVEN_QUANTIZATION: frozenset[WeightQuantization] = frozenset()
# KV cache dtypes other than "auto" proven the same way; an FP8 e4m3 cache ("fp8", "fp8_e4m3")
# has kernels and a backend path but no GPU parity yet.
PROVEN_KV_CACHE_DTYPES: frozenset[str] = frozenset()
FP8_KV_CACHE_DTYPES: tuple[str, ...] = ("fp8", "fp8_e4m3")  # vLLM's names, per-tensor scales


@dataclasses.dataclass(frozen=True)
class Proof:
    """One independent safety proof; `reason` is ELIGIBLE when it holds."""

    name: str
    reason: Reason
    detail: str = ""

    @property
    def holds(self) -> bool:
        return self.reason is Reason.ELIGIBLE


@dataclasses.dataclass(frozen=True)
class DecodeGraphCapability:
    """Composition of proofs. Eligible only if every required proof is present and holds."""

    proofs: tuple[Proof, ...]
    required: frozenset[str] = frozenset()

    @classmethod
    def compose(cls, proofs: Iterable[Proof], required: Iterable[str] = ()) -> DecodeGraphCapability:
        proofs = tuple(proofs)
        names = [p.name for p in proofs]
        assert len(names) == len(set(names)), f"duplicate proof names {names}"
        return cls(proofs=proofs, required=frozenset(required))

    @property
    def missing(self) -> tuple[str, ...]:
        present = {p.name for p in self.proofs}
        return tuple(sorted(self.required - present))

    @property
    def eligible(self) -> bool:
        return bool(self.proofs) and not self.missing and all(p.holds for p in self.proofs)

    @property
    def reasons(self) -> tuple[Reason, ...]:
        """Distinct deny reasons in proof order; (ELIGIBLE,) when eligible."""
        if self.eligible:
            return (Reason.ELIGIBLE,)
        out: list[Reason] = [p.reason for p in self.proofs if not p.holds]
        if self.missing or not self.proofs:
            out.append(Reason.UNPROVEN)
        return tuple(dict.fromkeys(out))

    def with_proofs(self, *proofs: Proof) -> DecodeGraphCapability:
        """A new report with `proofs` added (replacing same-named ones)."""
        names = {p.name for p in proofs}
        kept = tuple(p for p in self.proofs if p.name not in names)
        return DecodeGraphCapability(proofs=kept + tuple(proofs), required=self.required)

    def render(self) -> str:
        """Human-readable report (used by `moe-graphs doctor` and the start-up log)."""
        if self.eligible:
            return f"eligible: {REMEDY[Reason.ELIGIBLE]}"
        lines = ["not eligible for the plugin's CUDA graphs:"]
        for p in self.proofs:
            if not p.holds:
                detail = f" ({p.detail})" if p.detail else ""
                lines.append(f"  - {p.reason.value}{detail}\n      fix: {REMEDY[p.reason]}")
        for name in self.missing:
            lines.append(f"  - {Reason.UNPROVEN.value} (proof {name!r} missing)\n"
                         f"      fix: {REMEDY[Reason.UNPROVEN]}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ConfigFacts:
    """Engine settings that decide config-time eligibility (no vLLM types)."""

    architectures: tuple[str, ...]
    model_type: str
    has_mla: bool  # latent-KV attention (kv_lora_rank in the model config)
    dtype: str  # "bfloat16", "float16", "float32", ...
    kv_cache_dtype: str  # "auto" or e.g. "fp8"
    is_cuda: bool
    enforce_eager: bool
    tensor_parallel_size: int
    pipeline_parallel_size: int
    speculative: bool
    lora: bool
    offload: str  # "none", "uva", "uva_disabled" (copy fallback), "prefetch"
    plugin_enabled: bool = True
    disabled_by_env: bool = False
    head_size: int | None = None  # attention head size (None: not known)
    quantization: WeightQuantization | None = None  # None: unquantized weights
    sliding_window: int | None = None  # attention window in tokens; None: full attention
    runner_type: str = "generate"  # vLLM's runner: "generate" or "pooling"
    data_parallel_size: int = 1
    is_moe: bool = False  # the model has MoE layers (its data-parallel ranks step together)
    # compilation settings the user chose that the plugin's take-over would override, spelled
    # as flags ("-O3", "-cc.cudagraph_mode=FULL_DECODE_ONLY", ...); "" when none
    user_compilation: str = ""
    # --calculate-kv-scales: vLLM computes an FP8 cache's scales on the first forward with a
    # host read (`.item()`)
    calculate_kv_scales: bool = False
    # unproven configurations taken over for a GPU proof run (MOE_GRAPHS_UNPROVEN): "fp8"
    # (block-quantized FP8 weights), "fp8_kv" (an FP8 e4m3 KV cache)
    unproven: frozenset[str] = frozenset()
    # why vLLM would run block FP8 on kernels the plugin's proofs did not (DeepGEMM, FlashInfer,
    # Marlin, a --moe-backend); "" when its CUTLASS GEMM and Triton experts run
    fp8_kernels: str = ""


# Proofs that every runtime report must carry before replay is allowed.
CONFIG_PROOFS = ("env", "plugin_config", "platform", "architecture", "dtype", "quantization",
                 "sliding_window", "runner", "eager", "compilation", "parallelism",
                 "data_parallel", "speculative", "lora", "offload")
RUNTIME_PROOFS = ("storage",)


def _proof(name: str, ok: bool, reason: Reason, detail: str = "") -> Proof:
    return Proof(name, Reason.ELIGIBLE if ok else reason, "" if ok else detail)


def architecture_proof(facts: ConfigFacts) -> Proof:
    """MLA is classified before anything else is read; then the exact architecture set."""
    archs = set(facts.architectures)
    if facts.has_mla or archs & MLA_ARCHITECTURES or facts.model_type.startswith("deepseek"):
        return Proof("architecture", Reason.MLA_LAYOUT_UNSUPPORTED,
                     f"architectures={list(facts.architectures)}")
    if len(archs) != 1 or not archs <= SUPPORTED_ARCHITECTURES:
        return Proof("architecture", Reason.UNSUPPORTED_ARCHITECTURE,
                     f"architectures={list(facts.architectures)}")
    if facts.head_size is not None and facts.head_size not in SUPPORTED_HEAD_SIZES:
        return Proof("architecture", Reason.UNSUPPORTED_ARCHITECTURE,
                     f"head size {facts.head_size}; the attention kernels support "
                     f"{list(SUPPORTED_HEAD_SIZES)}")
    return Proof("architecture", Reason.ELIGIBLE)


def _unproven_block_fp8(facts: ConfigFacts) -> bool:
    """Block FP8 weights taken over unproven (MOE_GRAPHS_UNPROVEN=fp8) for a GPU proof run."""
    q = facts.quantization
    return (q is not None and q.fp8_scheme is Fp8Scheme.BLOCK and "fp8" in facts.unproven
            and q not in PROVEN_QUANTIZATION)


def quantization_proof(facts: ConfigFacts) -> Proof:
    """Unquantized or proven weights hold. Per-tensor FP8 on an MoE model is refused for good:
    the fused MoE takes one activation scale over all rows of a step, padding rows included, so
    a padded graph step is not the eager step. Block FP8 is taken over only unproven."""
    q = facts.quantization
    if q is not None and q.fp8_scheme is Fp8Scheme.PER_TENSOR and facts.is_moe:
        return Proof("quantization", Reason.FP8_PER_TENSOR_MOE,
                     f"quantization {q}, on an MoE model: the fused MoE takes one activation "
                     "scale over all rows of a step, padding rows included")
    if q is not None and (q in PROVEN_QUANTIZATION or _unproven_block_fp8(facts)) \
            and q.fp8_scheme is Fp8Scheme.BLOCK and facts.fp8_kernels:
        return Proof("quantization", Reason.FP8_UNPROVEN_KERNELS,
                     f"quantization {q}, on {facts.fp8_kernels}")
    if q is None or q in PROVEN_QUANTIZATION or _unproven_block_fp8(facts):
        return Proof("quantization", Reason.ELIGIBLE)
    return Proof("quantization", Reason.UNSUPPORTED_QUANTIZATION, f"quantization {q}")


def config_proofs(facts: ConfigFacts) -> tuple[Proof, ...]:
    """The config-time proofs, one per entry of CONFIG_PROOFS."""
    kv_ok = facts.kv_cache_dtype in {"auto", *PROVEN_KV_CACHE_DTYPES} or (
        facts.kv_cache_dtype in FP8_KV_CACHE_DTYPES and "fp8_kv" in facts.unproven)
    dtype_ok = facts.dtype in SUPPORTED_DTYPES and kv_ok and not facts.calculate_kv_scales
    kv_scales = (", --calculate-kv-scales (scales computed with a host read on the first forward)"
                 if facts.calculate_kv_scales else "")
    return (
        _proof("env", not facts.disabled_by_env, Reason.DISABLED_BY_ENV, "MOE_GRAPHS_DISABLE=1"),
        _proof("plugin_config", facts.plugin_enabled, Reason.DISABLED_BY_CONFIG,
               "moe_graphs.enabled=false"),
        _proof("platform", facts.is_cuda, Reason.NO_CUDA, "current platform is not CUDA"),
        architecture_proof(facts),
        _proof("dtype", dtype_ok, Reason.UNSUPPORTED_DTYPE,
               f"dtype={facts.dtype}, kv_cache_dtype={facts.kv_cache_dtype}{kv_scales}"),
        quantization_proof(facts),
        _proof("sliding_window", not facts.sliding_window, Reason.SLIDING_WINDOW,
               f"sliding window of {facts.sliding_window} tokens"),
        _proof("runner", facts.runner_type == "generate", Reason.POOLING_RUNNER,
               f"runner {facts.runner_type}"),
        _proof("eager", not facts.enforce_eager, Reason.ENFORCE_EAGER, "--enforce-eager is set"),
        # with --enforce-eager nothing is compiled or captured: the eager proof says why
        _proof("compilation", facts.enforce_eager or not facts.user_compilation,
               Reason.USER_COMPILATION, facts.user_compilation),
        _proof("parallelism", facts.pipeline_parallel_size == 1, Reason.PIPELINE_PARALLEL,
               f"pipeline_parallel_size={facts.pipeline_parallel_size}")
        if facts.pipeline_parallel_size != 1 else
        _proof("parallelism", facts.tensor_parallel_size == 1, Reason.TENSOR_PARALLEL,
               f"tensor_parallel_size={facts.tensor_parallel_size}"),
        # a dense model's data-parallel ranks are independent engines (vLLM runs each as DP 1)
        _proof("data_parallel", facts.data_parallel_size == 1 or not facts.is_moe,
               Reason.DATA_PARALLEL,
               f"data_parallel_size={facts.data_parallel_size} with an MoE model"),
        _proof("speculative", not facts.speculative, Reason.SPECULATIVE_DECODING,
               "a speculative config is set"),
        _proof("lora", not facts.lora, Reason.LORA, "--enable-lora is set"),
        _proof("offload", facts.offload in GRAPH_SAFE_OFFLOAD, Reason.OFFLOAD_NOT_GRAPH_SAFE,
               f"offload mode {facts.offload!r}"),
    )


def unproven_taken_over(facts: ConfigFacts) -> list[str]:
    """The unproven configurations of `facts` that MOE_GRAPHS_UNPROVEN lets the plugin take
    over (for a GPU proof run), each named with its setting; empty on a proven configuration."""
    taken = []
    if _unproven_block_fp8(facts):
        taken.append(f"FP8 weights (quantization {facts.quantization})")
    if ("fp8_kv" in facts.unproven and facts.kv_cache_dtype in FP8_KV_CACHE_DTYPES
            and facts.kv_cache_dtype not in PROVEN_KV_CACHE_DTYPES):
        taken.append(f"an FP8 KV cache (kv_cache_dtype {facts.kv_cache_dtype})")
    return taken


def config_capability(facts: ConfigFacts) -> DecodeGraphCapability:
    """Report from the config-time proofs (what `moe-graphs doctor` shows)."""
    return DecodeGraphCapability.compose(config_proofs(facts), required=CONFIG_PROOFS)


def runtime_capability(config: DecodeGraphCapability, *runtime: Proof) -> DecodeGraphCapability:
    """The engine's report: config proofs plus runtime proofs, all of them required."""
    return DecodeGraphCapability.compose(config.proofs + runtime,
                                         required=CONFIG_PROOFS + RUNTIME_PROOFS)
