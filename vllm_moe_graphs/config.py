"""Plugin configuration: `--additional-config '{"moe_graphs": {...}}'` -> `PluginConfig`.

Validated at engine start, before the model loads. Every error is a `ValueError` that names the
key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from collections.abc import Mapping
from typing import Any

CONFIG_KEY = "moe_graphs"

# The default query-token buckets of steps with prefill tokens (`token_buckets`): powers of two
# up to 256 tokens, where a step's time is launch-bound and padding costs little; four an octave
# from 256 to 2048 and eight from 2048 to 8192, where a step's GPU time grows with its padded
# tokens (a padded token is up to 25%, then 12.5%, of the step's work). Powers of two from 16 to
# 8192 padded a fifth to a third of the tokens of such steps under the serving benchmark on the
# H200, and one more key cost a capture of 0.1-0.4 s into the shared pool. Sixteen an octave
# from 2048 halved the padding of `long`'s GPU-bound steps and bought nothing measurable on an
# H100, for 292 MiB more pool (docs/benchmarking.md, results on an H100).
TOKEN_BUCKETS: tuple[int, ...] = (
    (16, 32, 64, 128)
    + tuple(base * k // 4 for base in (256, 512, 1024) for k in range(4, 8))
    + tuple(base * k // 8 for base in (2048, 4096) for k in range(8, 16))
    + (8192,))


# Requests a key of steps with prefill tokens holds by default (`mixed_requests`): steps below
# saturation carry fewer, so one graph per token bucket serves them all.
MIXED_REQUESTS = 256


class CaptureFailurePolicy(str, enum.Enum):
    """What a failed graph capture does."""

    QUARANTINE = "quarantine"  # never capture that key again; the engine keeps serving eagerly
    RAISE = "raise"  # fail the step (for debugging only)


@dataclasses.dataclass(frozen=True, slots=True)
class PluginConfig:
    """Frozen plugin settings. Every key is documented in docs/configuration.md."""

    enabled: bool = True
    # Decode batch sizes that get their own graph; a batch pads up to the next bucket. Up to
    # 1024, vLLM's max_num_seqs on a GPU with 70 GiB or more (fitted to the engine's), so a
    # saturated server's decode batches replay too; past 256 they are wide enough that 64, then
    # 128 apart pads at most a fifth of the rows.
    decode_batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256,
                                             320, 384, 448, 512, 640, 768, 896, 1024)
    # Longest context (tokens) a graph is planned for; a batch picks the smallest bucket that
    # holds its longest sequence. Past the last bucket the batch runs eager (`context_too_long`).
    context_buckets: tuple[int, ...] = (2048, 8192, 32768, 131072)
    # Eager steps a key runs at its padded size before it is captured lazily. One initializes
    # what the key's shapes need (the start-up warm-up compiled the kernels already), so the
    # capture that follows adds no warm-up run of its own; 0 captures at first sight, with one
    # warm-up run inside the capture.
    warmup_steps: int = 1
    # Upper bound of the shared graph memory pool; a capture past it is denied (`memory_budget`).
    graph_memory_budget_mib: int = 2048
    capture_failure_policy: CaptureFailurePolicy = CaptureFailurePolicy.QUARANTINE
    # Capture every bucket at start-up instead of lazily.
    precapture: bool = False
    # Linear layers with <= 16 input rows (decode) through the plugin's Triton GEMM
    # (integration/model/small_m_linear.py) instead of cuBLAS: "auto" (the layers where it measured
    # faster on the H200: more input than output features, >= 1024 outputs, i.e. o_proj and
    # down_proj), true (every eligible linear layer), false (cuBLAS everywhere).
    small_m_gemm: bool | str = "auto"
    # Qwen3 attention's q/k RMSNorm + RoPE as vLLM's one fused kernel
    # (integration/model/qk_norm_rope.py); attention modules it cannot serve stay unfused, by name.
    fuse_qk_norm_rope: bool = True
    # The residual-stream RMSNorms and the dense MLP's SiLU-and-mul rounded as stock vLLM's
    # torch.compile'd model rounds them (integration/model/compiled_numerics.py: fp32 residual
    # sum normalised, one rounding per output), by the plugin's Triton kernels; false: vLLM's
    # uncompiled CUDA kernels. Off until its numerics and speed are measured on a GPU.
    compiled_numerics: bool = False
    # Pure-decode steps prepare vLLM's input buffers on the host with a few copies
    # (integration/runner/decode_inputs.py) instead of vLLM's general path, and a replayed step
    # builds no attention metadata (the graph reads the persistent buffers); false: vLLM's path.
    fast_decode_inputs: bool = True
    # The LM head inside the decode forward, so inside the graph
    # (integration/model/graph_logits.py), for pure-decode batch buckets up to 64 rows (needs
    # fast_decode_inputs); false: vLLM computes the logits after the forward.
    logits_in_graph: bool = True
    # Sampling from CUDA graphs of the plugin's (integration/runner/graph_sampling.py): after a
    # step of up to 64 requests, a graph per batch bucket draws the tokens when every random
    # row uses top-k 1..64 (with any temperature, top-p, min-p, min-tokens, allowed / bad
    # words, structured output) and no request asks for a seed, logprobs, penalties or logit
    # bias; any other batch runs vLLM's sampler, counted by reason. Off until measured on a
    # GPU.
    sample_in_graph: bool = False
    # Steps that carry prefill tokens (prefill, chunked prefill, mixed) replayed from graphs
    # too, one per query-token bucket (requests padded to min(token bucket, 256); a step with
    # more requests to a power of two up to the largest decode batch bucket); false: they run
    # eager (`mixed_batch`) and only pure decode is graphed.
    mixed_graphs: bool = True
    # Query-token counts a step with prefill tokens pads up to (mixed_graphs); fitted to the
    # engine's max_num_batched_tokens; past the last one the step runs eager (`step_too_large`).
    # Powers of two where a step is host-bound, then four and eight buckets an octave where
    # its GPU time grows with the padded tokens (TOKEN_BUCKETS).
    token_buckets: tuple[int, ...] = TOKEN_BUCKETS
    # Requests a key of steps with prefill tokens is padded to: min(token bucket, this, the
    # largest decode batch bucket); a step with more (a saturated server's wide decode batch
    # next to a prefill chunk) takes a key padded to the next power of two, captured when such
    # a step first comes (idle capture leaves them). At the largest decode batch bucket no step
    # needs such a key and idle capture takes every key; a padded request adds only an empty
    # entry to the attention's schedule. 256 until the wider default is measured on the H200.
    mixed_requests: int = MIXED_REQUESTS
    # Attention of steps with prefill tokens: "auto" (FlashAttention 3 where vLLM has it, else
    # the plugin's kernel), "flash_attn" (FA3; where it is absent, the plugin's kernel with a
    # warning) or "triton" (the plugin's varlen kernel). FA3 runs with its schedule planned
    # outside the graph (integration/attention/flash_attn.py).
    prefill_attention: str = "auto"
    # The padding rows of a padded step skip the fused MoE's experts
    # (integration/model/moe_padding.py: vLLM's Triton experts, more than 64 experts, no expert
    # parallelism): no expert weights loaded and no expert GEMM rows for them; real rows are
    # bit-identical either way.
    skip_moe_padding: bool = True
    # With skip_moe_padding: the padding rows' expert ids written by the routing launch itself
    # (the plugin's Triton top-k softmax in place of vLLM's topk_softmax, ops/moe_router.py)
    # instead of a mask launch per MoE layer after vLLM's routing (49 launches a step on
    # Qwen3-30B-A3B). No slower in the decode benchmark on an H100; off until measured serving
    # on the H200.
    fuse_moe_padding_mask: bool = False
    # While the engine waits for requests, capture the keys traffic has not reached yet, one at
    # a time, in precapture's order (integration/patch/engine_core_idle.py): a fresh server's lazy
    # captures move out of its first minutes of serving, start-up stays as fast.
    idle_capture: bool = True
    # Threads that compile the fused-MoE kernel's variants of the start-up warm-up in parallel
    # (integration/startup/moe_warm_up.py: recorded from forwards that skip those launches, then
    # compiled through Triton's asynchronous compile), at most the machine's CPU count; 0: one
    # after the other, inside the warm-up's forwards. On a fresh node those compiles are most
    # of the start-up of Qwen3-30B-A3B (25 s of 37 s on the H200, one after the other). Above
    # 0, vLLM's top-k/top-p sampling kernel also compiles on a thread of its own from the start
    # of model loading to the end of the warm-up (integration/startup/sampler_warm_up.py).
    warm_up_compile_threads: int = 8
    # From the end of the start-up warm-up on, a niced subprocess without CUDA compiles into
    # Triton's cache the variants of vLLM's top-k/top-p sampling kernel that traffic can reach
    # (top-k and/or top-p, row counts divisible by 16 and not;
    # integration/startup/sampling_variants.py): the first batch of 8+ requests sampling with top-k
    # or top-p (Qwen3's generation config sets both) loads its variant instead of compiling it on
    # the engine's thread (2.4-9.3 s on an H100 host, every request waiting).
    compile_sampling_variants: bool = True

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> PluginConfig:
        """Read `additional_config["moe_graphs"]` (absent -> defaults)."""
        section = (additional_config or {}).get(CONFIG_KEY)
        if section is None:
            return cls()
        return cls.from_dict(section)

    @classmethod
    def from_dict(cls, raw: Any) -> PluginConfig:
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"additional_config[{CONFIG_KEY!r}] must be a JSON object, got "
                f"{type(raw).__name__} {raw!r}; e.g. "
                f'--additional-config \'{{"{CONFIG_KEY}": {{"graph_memory_budget_mib": 1024}}}}\''
            )
        allowed = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in allowed:
                raise ValueError(
                    f"unknown key {CONFIG_KEY}.{key} (value {value!r}); allowed keys: "
                    f"{', '.join(allowed)}"
                )
            values[key] = _PARSERS[key](key, value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["decode_batch_buckets"] = list(self.decode_batch_buckets)
        out["context_buckets"] = list(self.context_buckets)
        out["token_buckets"] = list(self.token_buckets)
        out["capture_failure_policy"] = self.capture_failure_policy.value
        return out


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{CONFIG_KEY}.{key}={value!r} must be true or false")
    return value


def _bool_or_auto(key: str, value: Any) -> bool | str:
    if value != "auto" and not isinstance(value, bool):
        raise ValueError(f'{CONFIG_KEY}.{key}={value!r} must be true, false or "auto"')
    return value


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{CONFIG_KEY}.{key}={value!r} must be an integer >= {minimum}, "
            f"got {type(value).__name__}"
        )
    if value < minimum:
        raise ValueError(f"{CONFIG_KEY}.{key}={value!r} must be an integer >= {minimum}")
    return value


def _buckets(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"{CONFIG_KEY}.{key}={value!r} must be a non-empty list of positive integers "
            f"in strictly increasing order, e.g. [1, 2, 4, 8]"
        )
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item <= 0:
            raise ValueError(
                f"{CONFIG_KEY}.{key}={value!r}: entry {item!r} is not a positive integer; "
                f"allowed: positive integers in strictly increasing order"
            )
    if any(b <= a for a, b in zip(value, value[1:])):
        raise ValueError(
            f"{CONFIG_KEY}.{key}={value!r} is not sorted in strictly increasing order; "
            f"use {sorted(set(value))!r}"
        )
    return tuple(value)


PREFILL_ATTENTION = ("auto", "triton", "flash_attn")


def _prefill_attention(key: str, value: Any) -> str:
    if value not in PREFILL_ATTENTION:
        raise ValueError(f"{CONFIG_KEY}.{key}={value!r} must be one of {list(PREFILL_ATTENTION)}")
    return value


def _policy(key: str, value: Any) -> CaptureFailurePolicy:
    accepted = [p.value for p in CaptureFailurePolicy]
    if value not in accepted:
        raise ValueError(f"{CONFIG_KEY}.{key}={value!r} must be one of {accepted}")
    return CaptureFailurePolicy(value)


_PARSERS = {
    "enabled": _bool,
    "decode_batch_buckets": _buckets,
    "context_buckets": _buckets,
    "warmup_steps": lambda k, v: _int(k, v, 0),
    "graph_memory_budget_mib": lambda k, v: _int(k, v, 0),
    "capture_failure_policy": _policy,
    "precapture": _bool,
    "small_m_gemm": _bool_or_auto,
    "fuse_qk_norm_rope": _bool,
    "compiled_numerics": _bool,
    "fast_decode_inputs": _bool,
    "logits_in_graph": _bool,
    "sample_in_graph": _bool,
    "mixed_graphs": _bool,
    "token_buckets": _buckets,
    "mixed_requests": lambda k, v: _int(k, v, 1),
    "prefill_attention": _prefill_attention,
    "skip_moe_padding": _bool,
    "fuse_moe_padding_mask": _bool,
    "idle_capture": _bool,
    "warm_up_compile_threads": lambda k, v: _int(k, v, 0),
    "compile_sampling_variants": _bool,
}
assert set(_PARSERS) == {f.name for f in dataclasses.fields(PluginConfig)}, "parser per field"


def plugin_config(additional_config: Mapping[str, Any] | None) -> PluginConfig:
    """`PluginConfig.from_additional_config`, parsed once per process for each distinct
    `moe_graphs` section: the engine's config hooks, the runner, every attention metadata
    builder and doctor all read the config here, so one section always yields one object."""
    section = (additional_config or {}).get(CONFIG_KEY)
    try:
        key = json.dumps(section, sort_keys=True)
    except (TypeError, ValueError):  # not JSON: let the parser name what is wrong
        return PluginConfig.from_additional_config(additional_config)
    return _parse_section(key)


@functools.lru_cache(maxsize=16)
def _parse_section(section_json: str) -> PluginConfig:
    return PluginConfig.from_additional_config({CONFIG_KEY: json.loads(section_json)})
