"""What the benchmarks share: model shapes (`shapes`), the vLLM modes compared (`modes`), the
engine worker that runs one model x mode per process (`mode_worker`), what it and its parent
exchange (`protocol`), the parent's plan and run of workers and the environment record
(`sweep`), vLLM facts read from its logs and engine (`vllm_facts`), the worker's profilers
(`profile_steps`, `startup_trace`), plots (`plot`) and statistics (`stats`).

Imports nothing from the benchmark rooms (`serving`, `decode`, `startup`, `kernels`).
"""
