"""Padding rows of a padded step skip the fused MoE (`skip_moe_padding`, on by default).

A graph key pads its step to the key's bucket: the rows past the real ones carry whatever the
persistent input buffers held, and vLLM routes them through every MoE layer like real tokens.
In a decode step (bound by expert weights) each padding row can pull up to top-k more experts'
weights per layer; in a prefill or mixed step (bound by the expert GEMMs) it costs top-k expert
rows of work. Stock vLLM pads its own graphs the same way.

Here the padding rows get an expert id that vLLM 0.26's Triton experts skip
(`fused_moe.py::_prepare_expert_assignment` and the kernels it feeds):

- `T * top_k * 4 <= E` (T the step's rows, E the experts): the naive block assignment, one
  block per (row, k) whose expert is the id itself; `fused_moe_kernel` writes zeros for expert
  -1 and loads no weight. Sentinel -1.
- otherwise `moe_align_block_size` counts and places only ids below E (its kernel for more than
  64 experts), so id E lands in no block: no GEMM rows, no weight tile. Sentinel E.
- E <= 64: vLLM's small-batch alignment kernel indexes ids unchecked. Not eligible.

Plan / run: `padded(n)` (host, around the step's forward or replay) writes the real row count
into a device scalar; inside the forward, captured with it, the padding rows' ids become the
sentinel in one of two ways:
- the mask (default): `begin(rows)` marks rows >= that count and each eligible layer's router
  output gets `masked_fill_` with the sentinel, one launch per layer after vLLM's `topk_softmax`;
- `fuse_moe_padding_mask`: each eligible layer routes through the plugin's top-k softmax
  (`ops/moe_router.py`), which reads the count and writes the sentinel in the same launch:
  no launch more than stock vLLM's. It replaces vLLM's routing in every step, padded or not
  (graphs and the kill switch route alike), so its rounding, not vLLM's, is the model's.
Real rows are bit-identical either way to an unpadded run of the same routing: the experts
kernel computes each output row from its own input row, with the tile config chosen by T, which
does not change. Padding rows come out as garbage, which the runner never returns (it slices
the real rows) and nothing reads across rows: padding tokens write no KV and belong to no
request's attention.

Eligible: vLLM's `MoERunner` whose experts are exactly `TritonExperts` (modular), with no
expert map (no expert parallelism), no EPLB, no zero-expert router, and more than 64 experts.
Refused layers keep vLLM's routing, by name and reason. The fused routing further needs vLLM's
`FusedTopKRouter` with softmax scoring (`patch/router_compute_routing.refusal`); an eligible
layer it refuses takes the mask.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from vllm_moe_graphs.integration.patch import router_compute_routing, router_select_experts

if TYPE_CHECKING:
    from vllm_moe_graphs.graphs.buckets import GraphKey

logger = logging.getLogger("vllm.moe_graphs")

MIN_EXPERTS = 65  # below, vLLM's small-batch `moe_align_block_size` kernel reads ids unchecked
SKIPPED = "skipped"


def sentinel(rows: int, top_k: int, num_experts: int) -> int:
    """The expert id vLLM 0.26's Triton experts skip in a step of `rows` rows (module doc)."""
    return -1 if rows * top_k * 4 <= num_experts else num_experts


class MoePadding:
    """The device state of the rewrite, fixed at install: row index [R] int32, the step's real
    row count [1] int32, the padding mask [R] bool (R = vLLM's token buffer rows)."""

    def __init__(self, max_rows: int, device: torch.device | str) -> None:
        self._index = torch.arange(max_rows, dtype=torch.int32, device=device)  # [R]
        self._real = torch.full((1,), max_rows, dtype=torch.int32, device=device)  # [1]
        self._pad = torch.zeros(max_rows, dtype=torch.bool, device=device)  # [R]
        self.active = False  # a padded forward is running (eager or being captured)
        self.layers: dict[str, str] = {}  # MoE layer name -> SKIPPED or why not
        self.masks = 0  # layers whose routing output takes the mask (`rewrite`)
        self.fused = 0  # layers routed through the plugin's top-k softmax (`route`)

    @property
    def max_rows(self) -> int:
        return self._index.shape[0]

    @contextlib.contextmanager
    def padded(self, real_rows: int) -> Iterator[None]:
        """A forward at a key's padded size whose first `real_rows` rows are real: the plan
        half (host, outside any graph; a graph replayed inside reads the count)."""
        if not 0 <= real_rows <= self.max_rows:
            raise ValueError(f"real_rows={real_rows!r} outside 0..{self.max_rows}")
        self._real.fill_(real_rows)
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def begin(self, rows: int) -> None:
        """The run half's first launch, inside the forward: mark rows >= the real count (no
        launch when no layer takes the mask)."""
        if self.active and self.masks:
            torch.ge(self._index[:rows], self._real, out=self._pad[:rows])

    def rewrite(self, top_k: int, num_experts: int) -> router_select_experts.Rewrite:
        """The in-place rewrite of one layer's `topk_ids` [T, K] (a no-op outside `padded`);
        the layer counts in `masks`."""
        self.masks += 1

        def apply(topk_ids: torch.Tensor) -> None:
            if not self.active:
                return
            rows = topk_ids.shape[0]
            assert rows <= self.max_rows, f"{rows} MoE rows, mask holds {self.max_rows}"
            topk_ids.masked_fill_(self._pad[:rows].unsqueeze(1),
                                  sentinel(rows, top_k, num_experts))

        return apply

    def route(self, top_k: int, num_experts: int,
              renormalize: bool) -> router_compute_routing.Route:
        """One layer's routing through the plugin's top-k softmax, the padding rows of a padded
        forward sent to the sentinel in the same launch (every row real outside `padded`); the
        layer counts in `fused`."""
        from vllm_moe_graphs.ops.moe_router import SUPPORTED_ID_DTYPES, topk_softmax

        self.fused += 1

        def route(logits: torch.Tensor,
                  indices_type: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
            rows = logits.shape[0]
            assert not self.active or rows <= self.max_rows, (
                f"{rows} MoE rows in a padded forward, vLLM has {self.max_rows} token rows")
            if logits.stride(-1) != 1:
                logits = logits.contiguous()  # [T, E]
            # vLLM's select_experts converts other id dtypes after the routing
            ids_dtype = indices_type if indices_type in SUPPORTED_ID_DTYPES else torch.int32
            return topk_softmax(logits, top_k, renormalize, ids_dtype=ids_dtype,
                                real=self._real if self.active else None,
                                sentinel=sentinel(rows, top_k, num_experts))

        return route


def padded_scope(padding: MoePadding | None,
                 real_rows: int | None) -> contextlib.AbstractContextManager[None]:
    """`padding.padded(real_rows)`, or nothing without the rewrite or for vLLM's own unpadded
    step (`real_rows` None)."""
    if padding is None or real_rows is None:
        return contextlib.nullcontext()
    return padding.padded(real_rows)


def key_scope(padding: MoePadding | None, key: GraphKey | None,
              real_rows: int) -> contextlib.AbstractContextManager[None]:
    """The MoE padding scope of a forward at `key`'s padded size with `real_rows` real rows
    (none for vLLM's own unpadded step, `key` None, or a key that cannot pad)."""
    pads = key is not None and key_pads(key.batch_bucket)
    return padded_scope(padding, real_rows if pads else None)


def key_pads(batch_bucket: int) -> bool:
    """Whether a step at a key of `batch_bucket` rows can carry padding rows: every key but a
    one-row one (a decode key of one request; every step has at least one real row). A forward
    at a key that cannot pad runs, and its graph captures, no mask launch (on Qwen3-30B-A3B's
    48 MoE layers: 49 fewer launches, about 50 us of a 3.5 ms one-request decode step)."""
    return batch_bucket > 1


def _experts_of(module: Any) -> Any:
    """The experts implementation behind a `MoERunner` (vLLM 0.26: routed experts -> quant
    method -> modular kernel -> fused experts), or None."""
    method = getattr(getattr(module, "routed_experts", None), "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if experts is not None else getattr(
        getattr(kernel, "impl", None), "fused_experts", None)


def refusal(module: Any) -> str | None:
    """Why the padding rows of `module` (a vLLM `MoERunner`) cannot skip its experts; None if
    they can."""
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter

    router, routed = getattr(module, "router", None), getattr(module, "routed_experts", None)
    if router is None or routed is None:
        return "no router / routed experts (not vLLM 0.26's MoERunner layout)"
    if isinstance(router, ZeroExpertRouter):
        return "zero-expert router"
    if getattr(router, "eplb_state", None) is not None:
        return "EPLB"
    if getattr(routed, "expert_map", None) is not None:
        return "expert map (expert parallelism)"
    method = getattr(routed, "quant_method", None)
    if getattr(method, "is_monolithic", False):
        return f"monolithic experts kernel ({type(method).__name__})"
    experts = _experts_of(module)
    if type(experts) is not TritonExperts:
        return f"experts {type(experts).__name__} (only vLLM's TritonExperts)"
    cfg = module.moe_config
    if cfg.num_local_experts != cfg.num_experts:
        return f"{cfg.num_local_experts} of {cfg.num_experts} experts local"
    if cfg.num_experts < MIN_EXPERTS:
        return f"{cfg.num_experts} experts (needs >= {MIN_EXPERTS})"
    return None


def install_moe_padding(model: torch.nn.Module, runner: Any,
                        fuse_mask: bool = False) -> MoePadding | None:
    """Route the padding rows of every eligible MoE layer of `model` past its experts, for the
    steps of vLLM model runner `runner` (its token buffer bounds the rows), through the fused
    routing where `fuse_mask` and the layer's router allow it, else the mask. None for a model
    without vLLM MoE layers; else the state, with `layers` saying which skip and `masks` how
    many of those take the mask."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    owners = {name: m for name, m in model.named_modules() if isinstance(m, MoERunner)}
    if not owners:
        return None
    padding = MoePadding(runner.input_ids.gpu.shape[0], runner.device)  # vLLM's token rows
    for name, module in owners.items():
        why = refusal(module)
        if why is None:
            cfg, router = module.moe_config, module.router
            unfused = router_compute_routing.refusal(router) if fuse_mask else None
            if fuse_mask and unfused is None:
                router_compute_routing.install(router, padding.route(
                    cfg.experts_per_token, cfg.num_experts, router.renormalize))
            else:
                router_select_experts.install(
                    router, padding.rewrite(cfg.experts_per_token, cfg.num_experts))
            if unfused is not None and padding.masks == 1:
                logger.info("moe_graphs: %s takes the padding mask, not the fused routing: %s",
                            name, unfused)
        padding.layers[name] = why or SKIPPED
    skipped = sum(v == SKIPPED for v in padding.layers.values())
    logger.info("moe_graphs: padding rows skip the experts in %d of %d MoE layers%s; %d "
                "through the fused routing, %d through the mask", skipped,
                len(padding.layers), "" if skipped == len(padding.layers) else
                f" (first refusal: {next(v for v in padding.layers.values() if v != SKIPPED)})",
                padding.fused, padding.masks)
    return padding
