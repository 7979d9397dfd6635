"""Patch: `_compute_routing` of the router of eligible fused-MoE layers (instance attribute).

Why: with `fuse_moe_padding_mask` the routing of a layer whose padding rows skip the experts
(`integration/model/moe_padding.py`) is one launch of the plugin's top-k softmax, which also sends
the padding rows to the sentinel id (`ops/moe_router.py`), in place of vLLM's `topk_softmax`
followed by a mask launch: a padded step costs no launch more than stock vLLM's.
How: `install` binds a `_compute_routing` that calls `route(router_logits, indices_type)` to
the router object (an instance attribute that shadows `FusedTopKRouter._compute_routing` for
that router only); vLLM's `select_experts` around it (routing capture hook, id dtype) runs
unchanged.
Removal: when vLLM's fused MoE takes a count of valid rows (as its expert-parallel paths do).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

# (router_logits [T, E], indices_type) -> (topk_weights [T, K] float32, topk_ids [T, K])
Route = Callable[[torch.Tensor, "torch.dtype | None"], tuple[torch.Tensor, torch.Tensor]]

_PARAMETERS = ["hidden_states", "router_logits", "indices_type", "input_ids"]


def refusal(router: Any) -> str | None:
    """Why `router`'s routing cannot be replaced by the plugin's top-k softmax; None if it can:
    exactly vLLM 0.26's `FusedTopKRouter` with softmax scoring and the `_compute_routing`
    signature this patch was written against."""
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

    if type(router) is not FusedTopKRouter:
        return f"router {type(router).__name__} (only vLLM's FusedTopKRouter)"
    if router.scoring_func != "softmax":
        return f"scoring function {router.scoring_func!r} (only softmax)"
    params = list(inspect.signature(FusedTopKRouter._compute_routing).parameters)[1:]
    if params != _PARAMETERS:
        return f"FusedTopKRouter._compute_routing takes {params}, this patch knows {_PARAMETERS}"
    return None


def install(router: Any, route: Route) -> None:
    original = router._compute_routing

    @functools.wraps(original)
    def _compute_routing(hidden_states: torch.Tensor, router_logits: torch.Tensor,
                         indices_type: torch.dtype | None, *,
                         input_ids: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return route(router_logits, indices_type)

    router._compute_routing = _compute_routing
