"""Decode CUDA graphs: bucket keys and the graph runner (no vLLM imports)."""

from vllm_moe_graphs.graphs.buckets import GraphKey, all_keys, pick_bucket, pick_key
from vllm_moe_graphs.graphs.runner import (Action, CapturedGraph, Decision, DecodeGraphRunner,
                                           cuda_capture)

__all__ = ["Action", "CapturedGraph", "Decision", "DecodeGraphRunner", "GraphKey", "all_keys",
           "cuda_capture", "pick_bucket", "pick_key"]
