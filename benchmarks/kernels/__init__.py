"""Kernel micro-benchmarks, each `python -m benchmarks.kernels.<name> --out FILE.json`: decode
attention (`attn`), the attention of steps with prefill tokens (`prefill`), the small-M GEMM
(`gemm`), MoE routing (`router`); every kernel timed in replays of one CUDA graph (`timing`).
What their command lines share: `cli`; decode attention's case and the kernels run on it:
`attn_case`.

Imports the harness, no other room.
"""
