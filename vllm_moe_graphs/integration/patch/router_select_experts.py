"""Patch: `select_experts` of the router of eligible fused-MoE layers (instance attribute).

Why: with `skip_moe_padding` the padding rows of a padded step (`integration/model/moe_padding.py`)
get an expert id that vLLM's Triton experts skip, so they cost no expert GEMM and load no
expert weights; vLLM's MoE runner offers no seam between routing and the experts.
How: `install` binds a wrapper to the router object (an instance attribute that shadows the
class method for that router only); the wrapper calls vLLM's `select_experts` unchanged and
rewrites the ids of the padding rows in place.
Removal: when vLLM's fused MoE takes a count of valid rows (as its expert-parallel paths do).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

Rewrite = Callable[[torch.Tensor], None]  # topk_ids [T, K], in place


def install(router: Any, rewrite: Rewrite) -> None:
    original = router.select_experts

    @functools.wraps(original)
    def select_experts(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        topk_weights, topk_ids = original(*args, **kwargs)
        rewrite(topk_ids)
        return topk_weights, topk_ids

    router.select_experts = select_experts
