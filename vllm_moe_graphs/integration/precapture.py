"""The stand-in model `MoeGraphsModelRunner.capture_model` swaps in while vLLM's `_dummy_run`
prepares each pre-captured key's padded decode batch (`precapture: true`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_moe_graphs.capability import Reason

if TYPE_CHECKING:
    import torch

    from vllm_moe_graphs.graphs.buckets import GraphKey
    from vllm_moe_graphs.integration.model_runner import MoeGraphsModelRunner


class PrecaptureModel:
    """Stands in for `self.model` during `capture_model`: vLLM's `_dummy_run` prepares a padded
    decode batch under its forward context and calls the model; this captures that key."""

    def __init__(self, runner: MoeGraphsModelRunner, key: GraphKey) -> None:
        self._runner, self._key = runner, key

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        r = self._runner
        r._mg_args = kwargs
        graphs = r._mg_graphs
        result = graphs.precapture([self._key])[self._key]
        out = graphs.output(self._key) if result is Reason.ELIGIBLE else None
        return out if out is not None else r._mg_model(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner._mg_model, name)
