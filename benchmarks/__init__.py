"""Benchmarks of vllm_moe_graphs against stock vLLM; what each measures and its newest results:
docs/benchmarking.md.

    serving/   python -m benchmarks.serving   TTFT / TPOT / throughput through `vllm serve`
    decode/    python -m benchmarks.decode    fixed-batch decode TPOT, modes side by side
    startup/   python -m benchmarks.startup   start-up to ready, cold and warm
    kernels/   python -m benchmarks.kernels.{attn,prefill,gemm,router}   kernel micro-benchmarks
    harness/   what they share: shapes, modes, the engine worker, plots
    gpu/       the shell drivers of the lent GPU machine
    results/   the newest result of each benchmark
"""
