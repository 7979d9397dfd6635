"""The V1 model runner and its per-step pipeline.

- `model_runner.py`: `MoeGraphsModelRunner`, vLLM's `GPUModelRunner` with thin overrides that
  forward to its one `GraphLifecycle`.
- `lifecycle.py`: `GraphLifecycle`, the plugin's state for one runner (KV binding, graph runner,
  per-step plan) and the entry to its start-up work.
- `decode_inputs.py`: a pure-decode step's inputs and bookkeeping, prepared by the plugin.
- `graph_sampling.py`: the runner's `_sample` from sampler graphs where the batch allows.
- `buffers.py`: what the runner reads of vLLM's persistent buffers and KV tensors.

May import model/, attention/, startup/, patch/ and the engine-config glue. `decode_inputs.py`,
`graph_sampling.py` and `buffers.py` are on the step path: they never import startup/.
"""
