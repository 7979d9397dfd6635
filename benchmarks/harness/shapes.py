"""Model shapes and the physical floor of one decode step.

The shapes are the config directories shipped in `vllm_moe_graphs/model_configs/<name>/`, and
their FP8 variants as operators serve them on one H100 (`<name>-fp8`: block-quantized FP8
weights in the form of Qwen's -FP8 releases; `<name>-fp8-kv8`: with an FP8 KV cache too).
`decode_step_bytes` is the byte model behind the `floor_ms` column: the bytes one decode step must
read from HBM at the least, which divided by the measured copy bandwidth gives a lower bound on the
time per output token.

Legend: B = batch (sequences in the step), C = context (KV tokens per sequence), D = hidden,
H / KV = query / key-value heads, d = head_dim, E = experts, k = experts per token (top-k).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")
REPO_ROOT = Path(__file__).resolve().parents[2]
FP8_VARIANTS = {"fp8": False, "fp8-kv8": True}  # suffix -> FP8 KV cache too
FP8_BASES = ("qwen3-8b", "qwen3-30b-a3b")
SHAPES = MODELS + tuple(f"{b}-{v}" for b in FP8_BASES for v in FP8_VARIANTS)
BLOCK = [128, 128]
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": BLOCK}


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """A benchmark shape: a shipped config, or its FP8 variant (module docstring)."""

    name: str
    base: str  # the shipped config it derives from
    fp8_weights: bool = False
    fp8_kv: bool = False

    @property
    def engine_args(self) -> tuple[str, ...]:
        """`vllm serve` flags every mode needs for this shape (stock on the same flags)."""
        return ("--kv-cache-dtype", "fp8") if self.fp8_kv else ()

    @property
    def llm_kwargs(self) -> dict[str, Any]:
        return {"kv_cache_dtype": "fp8"} if self.fp8_kv else {}

    @property
    def unproven(self) -> str:
        """MOE_GRAPHS_UNPROVEN a plugin mode needs to take this shape over ("": none): the FP8
        formats no GPU proof has lifted from deny-by-default yet."""
        from vllm_moe_graphs.capability import PROVEN_KV_CACHE_DTYPES, PROVEN_QUANTIZATION

        parts = ["fp8"] if self.fp8_weights and not any(
            q.method == "fp8" for q in PROVEN_QUANTIZATION) else []
        if self.fp8_kv and "fp8" not in PROVEN_KV_CACHE_DTYPES:
            parts.append("fp8_kv")
        return ",".join(parts)

    def plugin_env(self, plugin: bool) -> dict[str, str]:
        """What a mode's engine environment adds on this shape: a plugin mode takes the
        unproven FP8 formats over until a GPU proof lifts them; stock runs as it is."""
        return {"MOE_GRAPHS_UNPROVEN": self.unproven} if plugin and self.unproven else {}


def shape(name: str) -> Shape:
    """The shape named `name` (one of SHAPES); ValueError naming them otherwise."""
    if name in MODELS:
        return Shape(name, name)
    for suffix, kv8 in FP8_VARIANTS.items():
        base = name.removesuffix(f"-{suffix}")
        if base != name and base in FP8_BASES:
            return Shape(name, base, fp8_weights=True, fp8_kv=kv8)
    raise ValueError(f"unknown shape {name!r}; expected one of: {', '.join(SHAPES)}")


def moe_layers(hf: dict[str, Any]) -> set[int]:
    """The layers whose MLP is sparse (Qwen3MoeDecoderLayer's rule)."""
    n = int(hf["num_hidden_layers"])
    if not hf.get("num_experts"):
        return set()
    step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
    return {i for i in range(n) if i not in dense and (i + 1) % step == 0}


def fp8_block_config(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` with the block FP8 quantization_config of Qwen's -FP8 releases (the LM head and
    every MoE router gate left in bf16); ValueError when a quantized dimension is not a
    multiple of 128."""
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    dims = {"hidden_size": hf["hidden_size"], "intermediate_size": hf["intermediate_size"],
            "q heads x head_dim": hf["num_attention_heads"] * head_dim,
            "kv heads x head_dim": hf["num_key_value_heads"] * head_dim}
    if hf.get("num_experts"):
        dims["moe_intermediate_size"] = hf["moe_intermediate_size"]
    odd = {k: v for k, v in dims.items() if int(v) % BLOCK[0]}
    if odd:
        raise ValueError(f"block FP8 needs multiples of {BLOCK[0]}; got {odd}")
    ignore = ([] if hf.get("tie_word_embeddings") else ["lm_head"]) + [
        f"model.layers.{i}.mlp.gate" for i in sorted(moe_layers(hf))]
    return {**hf, "torch_dtype": "bfloat16",
            "quantization_config": {**FP8_QUANTIZATION, "modules_to_not_convert": ignore}}


def shipped_config_dir(name: str) -> Path:
    """The shipped config directory of shape `name`.

    Located through the installed `vllm_moe_graphs` package when there is one (found with
    `importlib.util.find_spec`, which does not run the package), else in this repository."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of: {', '.join(MODELS)}")
    candidates: list[Path] = []
    spec = importlib.util.find_spec("vllm_moe_graphs")
    if spec is not None and spec.submodule_search_locations:
        candidates += [
            Path(loc) / "model_configs" / name for loc in spec.submodule_search_locations
        ]
    candidates.append(REPO_ROOT / "vllm_moe_graphs" / "model_configs" / name)
    for cand in candidates:
        if (cand / "config.json").is_file():
            return cand
    raise ValueError(
        f"no config.json for {name!r}; looked in: {', '.join(str(c) for c in candidates)}"
    )


def read_config(config_dir: str | Path) -> dict[str, Any]:
    path = Path(config_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from exc


def prepare_config_dir(name: str, num_layers: int | None, work_dir: Path) -> tuple[Path, int]:
    """The config directory vLLM should load for shape `name`, and the layer count it has.

    With `num_layers`, writes `<work_dir>/configs/<name>-L<n>/config.json`: the shipped config
    with `num_hidden_layers` (and the layer-indexed fields) cut to `num_layers`; an FP8 variant's
    `<work_dir>/configs/<name>[-L<n>]/config.json` carries its quantization_config."""
    s = shape(name)
    src = shipped_config_dir(s.base)
    cfg = read_config(src)
    full = int(cfg["num_hidden_layers"])
    if (num_layers is None or num_layers == full) and not s.fp8_weights:
        return src, full
    num_layers = full if num_layers is None else num_layers
    if not 1 <= num_layers <= full:
        raise ValueError(f"--num-layers {num_layers} for {name}: expected 1..{full}")
    cfg["num_hidden_layers"] = num_layers
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), num_layers)
    if cfg.get("mlp_only_layers"):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < num_layers]
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    if s.fp8_weights:
        cfg = fp8_block_config(cfg)
    dst = work_dir / "configs" / (name if num_layers == full else f"{name}-L{num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst, num_layers


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes the byte model needs, read from a Qwen3 / Qwen3-MoE config.json."""

    hidden: int  # D
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # KV
    head_dim: int  # d
    intermediate: int  # dense MLP width
    vocab: int
    num_experts: int = 0  # E (0 = dense model)
    top_k: int = 0  # k
    moe_intermediate: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    dtype_bytes: int = 2  # bf16 weights and KV cache
    linear_bytes: int = 2  # attention and MLP / expert weights: 1 for FP8 (scales left out)
    kv_dtype_bytes: int = 2  # 1 for an FP8 KV cache

    @classmethod
    def from_config(cls, cfg: dict[str, Any], fp8_kv: bool = False) -> ModelShape:
        """The byte model of `cfg` (a block FP8 quantization_config: 1-byte linear weights)
        with a bf16 KV cache, or an FP8 one."""
        fp8 = (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            return cls(
                hidden=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                num_experts=int(cfg.get("num_experts") or 0),
                top_k=int(cfg.get("num_experts_per_tok") or 0),
                moe_intermediate=int(cfg.get("moe_intermediate_size") or 0),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
                linear_bytes=1 if fp8 else 2,
                kv_dtype_bytes=1 if fp8_kv else 2,
            )
        except KeyError as exc:
            raise ValueError(
                f"model config lacks {exc.args[0]!r}, needed by the byte model"
            ) from exc

    def is_sparse_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule (`Qwen3MoeDecoderLayer`): experts unless listed in mlp_only_layers."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class StepBytes:
    weights: int  # parameters the step must read, in bytes
    kv: int  # KV cache the step must read, in bytes
    experts_touched: int  # per MoE layer (0 for dense)

    @property
    def total(self) -> int:
        return self.weights + self.kv


def decode_step_bytes(shape: ModelShape, batch: int, context: int) -> StepBytes:
    """Least bytes one decode step of `batch` sequences with `context` KV tokens each reads.

    Weights: per layer q/k/v/o projections, q/k RMSNorm and the two layer norms; the dense MLP
    (gate, up, down) or, for a MoE layer, the router plus the experts the batch can touch,
    min(E, B * k), each 3 * D * moe_intermediate; then the final norm, the whole LM head
    (V x D, read in full even when tied to the embedding) and the B embedding rows looked up.
    Projections and experts at `linear_bytes` each, the rest at `dtype_bytes`. KV: B * C *
    kv_bytes_per_token (the new token's write is left out). Activations are left out.
    """
    if batch < 1 or context < 0:
        raise ValueError(
            f"batch must be >= 1 and context >= 0, got batch={batch} context={context}"
        )
    d_model, q_width = shape.hidden, shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    attn = d_model * q_width + 2 * d_model * kv_width + q_width * d_model  # q, k, v, o
    norms = 2 * shape.head_dim + 2 * d_model  # q_norm, k_norm, input + post-attention norms
    touched = min(shape.num_experts, batch * shape.top_k) if shape.num_experts else 0
    linear, params = 0, 0  # parameters at linear_bytes, at dtype_bytes
    for layer in range(shape.num_layers):
        if shape.is_sparse_layer(layer):
            params += d_model * shape.num_experts  # the router
            linear += touched * 3 * d_model * shape.moe_intermediate
        else:
            linear += 3 * d_model * shape.intermediate
        linear += attn
        params += norms
    params += d_model  # final norm
    params += shape.vocab * d_model  # LM head
    params += min(batch, shape.vocab) * d_model  # embedding rows of the batch's tokens
    kv = batch * context * shape.kv_bytes_per_token()
    return StepBytes(weights=linear * shape.linear_bytes + params * shape.dtype_bytes, kv=kv,
                     experts_touched=touched)


def resident_weight_bytes(shape: ModelShape) -> int:
    """Bytes of the parameters one engine holds: every layer with all its experts, the whole
    embedding and the LM head (counted apart even when tied: an upper bound)."""
    return decode_step_bytes(shape, batch=shape.vocab, context=0).weights


def floor_ms(step_bytes: int, bandwidth_gbps: float | None) -> float | None:
    """Time to stream `step_bytes` at `bandwidth_gbps` (GB/s, 1e9 bytes), in milliseconds."""
    if not bandwidth_gbps or bandwidth_gbps <= 0:
        return None
    return step_bytes / (bandwidth_gbps * 1e9) * 1e3
