"""The plugin's CUDA graphs: bucket keys, the step decision and plan, capture and the graph runner
(no vLLM)."""

from vllm_moe_graphs.graphs.buckets import GraphKey, all_keys, pick_bucket, pick_key
from vllm_moe_graphs.graphs.capture import CapturedGraph, cuda_capture
from vllm_moe_graphs.graphs.runner import Action, Decision, DecodeGraphRunner

__all__ = ["Action", "CapturedGraph", "Decision", "DecodeGraphRunner", "GraphKey", "all_keys",
           "cuda_capture", "pick_bucket", "pick_key"]
