"""What the benchmarks share: model shapes (`shapes`), the vLLM modes compared (`modes`), the
requests' sampling presets (`sampling`), the engine worker that runs one model x mode per process
(`mode_worker`) and measures its points (`decode_points`), what it and its parent exchange
(`protocol`), the parent's plan and run of workers (`sweep`) each as a child process
(`worker_process`), the machine's GPU checks and the environment record (`machine`), vLLM facts
read from its logs and engine (`vllm_facts`), the worker's profilers (`profile_steps`,
`profile_prefill`, `startup_trace`), plots (`plot`) and statistics (`stats`).

Imports nothing from the benchmark rooms (`serving`, `decode`, `startup`, `kernels`).
"""
