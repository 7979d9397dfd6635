"""Exact-type registry of the models and attention layers whose KV cache the plugin may own.

Only vLLM 0.26's `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` and their attention modules
`Qwen3Attention` / `Qwen3MoeAttention` (each holding exactly one vLLM `Attention` at
`model.layers.<i>.self_attn.attn`) are accepted, by exact type: a subclass (Mellum, the Qwen3-VL
text models, embedding adapters) may change the forward or the KV layout and is refused.
DeepSeek V2/V3 (MLA, latent KV) is classified `mla_layout_unsupported` from the config or the
class name before anything else is read (no head_dim, no vLLM import); anything else is
`unsupported_architecture`.

This is the only module that imports vLLM model classes; the imports happen on first use (in
the worker, where vLLM has already imported them), never at plugin registration.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_moe_graphs.capability import (
    MLA_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    Proof,
    Reason,
)

if TYPE_CHECKING:
    from torch import nn

    from vllm_moe_graphs.kv.identity import StorageIdentity

CONFIG_PROOF = "model_config"
CLASS_PROOF = "model_class"
LAYERS_PROOF = "model_layers"
STORAGE_MATCH_PROOF = "storage_layers"

MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"})
# Deny-only, matched by name anywhere in the MRO so that no DeepSeek module is imported.
MLA_CLASS_NAMES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                             "DeepseekV2MLAAttention", "MLAAttention",
                             "MultiHeadLatentAttentionWrapper"})
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.attn$")


@dataclasses.dataclass(frozen=True)
class _Accepted:
    models: dict[type, str]  # exact class -> family
    owners: dict[type, str]  # exact attention module class -> family
    attention: type  # vLLM's Attention, exactly
    layer_base: type  # AttentionLayerBase: every KV-owning layer is one


@functools.cache
def _accepted() -> _Accepted:
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeForCausalLM

    return _Accepted(models={Qwen3ForCausalLM: "qwen3", Qwen3MoeForCausalLM: "qwen3_moe"},
                     owners={Qwen3Attention: "qwen3", Qwen3MoeAttention: "qwen3_moe"},
                     attention=Attention, layer_base=AttentionLayerBase)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_mla_class(cls: type) -> bool:
    return any(c.__name__ in MLA_CLASS_NAMES for c in cls.__mro__)


def _get(config: Mapping[str, Any] | Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def classify_config(config: Mapping[str, Any] | Any) -> Proof:
    """Proof("model_config") from an HF config (a `config.json` dict or a PretrainedConfig).
    MLA is decided first, from `kv_lora_rank` / `use_mla` / model_type / architectures only."""
    archs = tuple(_get(config, "architectures") or ())
    model_type = str(_get(config, "model_type") or "")
    if (_get(config, "kv_lora_rank") or _get(config, "use_mla")
            or model_type in MLA_MODEL_TYPES or set(archs) & MLA_ARCHITECTURES):
        return Proof(CONFIG_PROOF, Reason.MLA_LAYOUT_UNSUPPORTED,
                     f"model_type={model_type!r}, architectures={list(archs)}")
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        return Proof(CONFIG_PROOF, Reason.UNSUPPORTED_ARCHITECTURE,
                     f"architectures={list(archs)}, expected one of "
                     f"{sorted(SUPPORTED_ARCHITECTURES)}")
    return Proof(CONFIG_PROOF, Reason.ELIGIBLE)


def _classify_type(cls: type, which: str, proof_name: str) -> Proof:
    if _is_mla_class(cls):  # before importing anything
        return Proof(proof_name, Reason.MLA_LAYOUT_UNSUPPORTED, _qualname(cls))
    accepted: dict[type, str] = getattr(_accepted(), which)
    if cls in accepted:
        return Proof(proof_name, Reason.ELIGIBLE)
    bases = [b.__name__ for b in accepted if issubclass(cls, b)]
    why = f" (a subclass of {bases[0]}: exact type required)" if bases else ""
    return Proof(proof_name, Reason.UNSUPPORTED_ARCHITECTURE, f"{_qualname(cls)}{why}")


def classify_model_class(cls: type) -> Proof:
    """Proof("model_class"): ELIGIBLE only for exactly Qwen3ForCausalLM / Qwen3MoeForCausalLM."""
    return _classify_type(cls, "models", CLASS_PROOF)


def classify_layer_type(cls: type) -> Proof:
    """Proof("model_layers") for an attention module class: exactly Qwen3Attention /
    Qwen3MoeAttention."""
    return _classify_type(cls, "owners", LAYERS_PROOF)


@dataclasses.dataclass(frozen=True)
class RegisteredLayer:
    name: str  # vLLM layer name (forward-context / kv_caches key)
    index: int
    family: str  # "qwen3" | "qwen3_moe"
    num_kv_heads: int  # on this TP rank
    head_size: int


class AttentionLayerRegistry:
    """Per-layer registration: unique indices, no gaps, exact types. Denials are sticky: the
    first one is what `proof()` reports."""

    def __init__(self) -> None:
        self._layers: dict[int, RegisteredLayer] = {}
        self._denial: Proof | None = None

    def _deny(self, reason: Reason, detail: str) -> Proof:
        proof = Proof(LAYERS_PROOF, reason, detail)
        if self._denial is None:
            self._denial = proof
        return proof

    def register(self, prefix: str, module: nn.Module) -> Proof:
        """Register the attention module `module` found at `prefix` ('model.layers.7.self_attn');
        its vLLM Attention must be `module.attn`, named f'{prefix}.attn'."""
        kind = classify_layer_type(type(module))
        if not kind.holds:
            return self._deny(kind.reason, f"{prefix}: {kind.detail}")
        attn = getattr(module, "attn", None)
        if type(attn) is not _accepted().attention:
            return self._deny(Reason.UNSUPPORTED_ARCHITECTURE,
                              f"{prefix}.attn is {type(attn).__qualname__}, expected exactly "
                              "vLLM's Attention")
        name = str(getattr(attn, "layer_name", ""))
        match = LAYER_NAME.match(name)
        if name != f"{prefix}.attn" or match is None:
            return self._deny(Reason.UNSUPPORTED_ARCHITECTURE,
                              f"layer name {name!r} at {prefix!r}: expected "
                              "'model.layers.<i>.self_attn.attn'")
        index = int(match[1])
        if index in self._layers or name in self.layer_indices:
            return self._deny(Reason.UNSUPPORTED_ARCHITECTURE,
                              f"duplicate layer {name!r} (index {index})")
        self._layers[index] = RegisteredLayer(name, index, _accepted().owners[type(module)],
                                              int(attn.num_kv_heads), int(attn.head_size))
        return Proof(LAYERS_PROOF, Reason.ELIGIBLE)

    @property
    def layers(self) -> tuple[RegisteredLayer, ...]:
        return tuple(self._layers[i] for i in sorted(self._layers))

    @property
    def layer_indices(self) -> dict[str, int]:
        """name -> index, what `PagedKVStorage.bind(layer_indices=...)` takes."""
        return {x.name: x.index for x in self._layers.values()}

    def proof(self) -> Proof:
        if self._denial is not None:
            return self._denial
        if not self._layers:
            return Proof(LAYERS_PROOF, Reason.UNSUPPORTED_ARCHITECTURE,
                         "no Qwen3 / Qwen3-MoE attention layer registered")
        missing = sorted(set(range(max(self._layers) + 1)) - set(self._layers))
        if missing:
            return Proof(LAYERS_PROOF, Reason.UNSUPPORTED_ARCHITECTURE,
                         f"layer indices have gaps: missing {missing}")
        return Proof(LAYERS_PROOF, Reason.ELIGIBLE)

    def match_storage(self, identity: StorageIdentity) -> Proof:
        """Proof("storage_layers"): the storage binds exactly these layers, with these indices,
        KV head counts and head sizes."""
        if identity.layer_indices != self.layer_indices:
            return Proof(STORAGE_MATCH_PROOF, Reason.STORAGE_IDENTITY_CHANGED,
                         f"storage layers {sorted(identity.layer_indices.items())} != model "
                         f"layers {sorted(self.layer_indices.items())}")
        for got in identity.layers:
            want = self._layers[got.index]
            if (got.num_kv_heads, got.head_size) != (want.num_kv_heads, want.head_size):
                return Proof(STORAGE_MATCH_PROOF, Reason.STORAGE_IDENTITY_CHANGED,
                             f"layer {got.name!r}: KV tensor has {got.num_kv_heads} heads of "
                             f"{got.head_size}, model has {want.num_kv_heads} of "
                             f"{want.head_size}")
        return Proof(STORAGE_MATCH_PROOF, Reason.ELIGIBLE)


@functools.cache
def _proven_fp8_kernels() -> tuple[type, ...]:
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    return CutlassFp8BlockScaledMMKernel, TritonExperts


def unproven_fp8_kernel(module: Any) -> str | None:
    """The kernel an FP8 layer of vLLM 0.26 runs (a linear layer's `fp8_linear`, a fused MoE's
    experts), when it is not one the plugin's FP8 proofs ran on (vLLM's CUTLASS block GEMM,
    Triton experts); None for those and for layers without FP8 weights. The config-time check
    (`fp8_unproven_kernels`) predicts vLLM's choice; this reads what it chose."""
    method = getattr(module, "quant_method", None)
    if method is None or "Fp8" not in type(method).__name__:
        return None
    kernel = getattr(method, "fp8_linear", None)
    if kernel is None and (moe := getattr(method, "moe_kernel", None)) is not None:
        kernel = getattr(getattr(moe, "impl", None), "fused_experts", None)
    if kernel is None or type(kernel) in _proven_fp8_kernels():
        return None  # e.g. an FP8 KV cache's method: no weights
    return type(kernel).__name__


def register_model(model: nn.Module) -> AttentionLayerRegistry:
    """Classify `model` (the unwrapped vLLM model) by exact type, then register every attention
    module; any other KV-owning layer (an AttentionLayerBase not claimed) denies, and so does an
    FP8 layer on a kernel the FP8 proofs did not run (`unproven_fp8_kernel`)."""
    registry = AttentionLayerRegistry()
    kind = classify_model_class(type(model))
    if not kind.holds:
        registry._deny(kind.reason, kind.detail)
        return registry
    acc = _accepted()
    claimed: set[int] = set()
    for prefix, module in model.named_modules():
        if type(module) in acc.owners or _is_mla_class(type(module)):
            registry.register(prefix, module)
            claimed.add(id(getattr(module, "attn", None)))
    for prefix, module in model.named_modules():
        if isinstance(module, acc.layer_base) and id(module) not in claimed:
            registry._deny(Reason.UNSUPPORTED_ARCHITECTURE,
                           f"attention layer {prefix!r} ({type(module).__qualname__}) is not "
                           "owned by a Qwen3 attention module")
        if (kernel := unproven_fp8_kernel(module)) is not None:
            registry._deny(Reason.FP8_UNPROVEN_KERNELS, f"{prefix!r} runs {kernel}")
    return registry
