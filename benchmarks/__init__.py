"""Benchmarks for vllm_moe_graphs: `python -m benchmarks.decode --help`."""
