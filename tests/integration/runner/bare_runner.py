"""A `MoeGraphsModelRunner` built without vLLM's `__init__` (it needs CUDA), for the override
tests on CPU: `_bare_runner` binds the plugin's storage over fake KV layers and vLLM's persistent
input buffers; `_stepping_runner` steps a toy model with decode graphs through vLLM's own
`_determine_batch_execution_and_padding` and `_model_forward` bodies under the plugin's overrides;
`_in_step` / `_step` run one step the way `execute_model` does."""

from __future__ import annotations

import contextlib

import pytest

gpu_model_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
GPUModelRunner = gpu_model_runner.GPUModelRunner

from vllm_moe_graphs.integration.runner import buffers  # noqa: E402
from vllm_moe_graphs.integration.runner.model_runner import MoeGraphsModelRunner  # noqa: E402


def _kv(num_blocks: int = 4):
    import torch

    return torch.zeros(num_blocks, 2, 16, 2 * 8)  # [NB, Hkv, BS, 2 * D]


def _bare_runner(layers: dict):
    import types

    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.integration.runner.lifecycle import GraphLifecycle
    from vllm_moe_graphs.kv.storage import PagedKVStorage, Phase

    import torch

    ns = types.SimpleNamespace
    r = MoeGraphsModelRunner.__new__(MoeGraphsModelRunner)
    r.moe_graphs = GraphLifecycle(r, PluginConfig(), PagedKVStorage())
    r.sampler_compile = r.sampling_variants = None  # as __init__ leaves them
    r.device = torch.device("cpu")
    r.cache_config = ns(cache_dtype="auto", num_gpu_blocks=4)
    ctx = {name: ns(kv_cache=t) for name, t in layers.items()}
    r.compilation_config = ns(static_forward_context=ctx)
    r.kv_caches = list(layers.values())
    # vLLM's persistent input buffers, as GPUModelRunner.__init__ makes them (small)
    r.input_ids, r.query_start_loc = ns(gpu=torch.zeros(8, dtype=torch.int32)), ns(
        gpu=torch.zeros(9, dtype=torch.int32))
    r.positions, r.seq_lens = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    r.input_batch = ns(block_table=ns(block_tables=[ns(
        block_table=ns(gpu=torch.zeros(8, 4, dtype=torch.int32)),
        slot_mapping=ns(gpu=torch.zeros(8, dtype=torch.int64)))]))
    r.attn_groups = []
    r.moe_graphs.storage.bind(layers, phase=Phase.SERVING,
                              buffers=buffers.graph_buffers(r))
    r.moe_graphs.watch_kv(layers)
    return r


def _stepping_runner(warmup_steps: int = 1):
    """A runner stepping the toy model with decode graphs only (mixed_graphs off; the mixed
    tests turn it on with `_mixed_graphs_on`)."""
    import dataclasses
    import types

    import torch
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from tests.graphs.test_runner import Emulated
    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner

    ns = types.SimpleNamespace
    r = _bare_runner({"model.layers.0.self_attn.attn": _kv()})
    r.moe_graphs.storage.check_devices("cpu", "cpu")
    r.uniform_decode_query_len = 1
    r.model_config = ns(is_encoder_decoder=False)
    r.input_batch.lora_id_to_lora_request = {}
    r.compilation_config.pass_config = ns(enable_sp=False)
    r.vllm_config = ns(parallel_config=ns(data_parallel_size=1, tensor_parallel_size=1),
                       observability_config=ns(cudagraph_metrics=False))
    r.parallel_config = r.vllm_config.parallel_config
    # vLLM's dispatcher with cudagraph_mode=NONE (what the take-over configures): no padding
    r.cudagraph_dispatcher = ns(dispatch=lambda num_tokens, **_: (CUDAGraphMode.NONE,
                                                                  BatchDescriptor(num_tokens)))
    r.optimistic_seq_lens_cpu = torch.zeros(8, dtype=torch.int32)
    r.model = lambda input_ids, **_: input_ids.float()[:, None] * 2  # [T, 1]
    capture = Emulated()
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, mixed_graphs=False)
    r.moe_graphs.graphs = DecodeGraphRunner(None, PluginConfig(warmup_steps=warmup_steps,
                                                               mixed_graphs=False),
                                            storage=r.moe_graphs.storage, capture_fn=capture,
                                            new_pool=object)
    return r, capture, CUDAGraphMode


@contextlib.contextmanager
def _in_step(r, num_reqs: int, query_lens: list[int], metadata: list | None = None,
             fast_inputs: bool = False, executing: bool = True):
    """execute_model's calls of one step up to the forward, inside its step scope (`executing`;
    outside: one of vLLM's dummy runs); yields (mode, descriptor, output) with the scope still
    open (what execute_model does next, e.g. compute_logits, goes in the block);
    `fast_inputs`: the plugin prepared the inputs (`DecodeInputs`)."""
    import numpy as np
    import torch

    num_tokens = sum(query_lens)
    r.optimistic_seq_lens_cpu[:num_reqs] = torch.arange(10, 10 + num_reqs)
    with r.moe_graphs.step() if executing else contextlib.nullcontext() as scope:
        if fast_inputs:
            scope.fast_inputs = True
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            num_tokens, num_reqs, np.array(query_lens, dtype=np.int32), max(query_lens), False)
        if metadata is not None:  # execute_model's next call, with the padded sizes
            metadata.append(r._build_attention_metadata(
                num_tokens, num_reqs, max(query_lens), num_tokens_padded=desc.num_tokens,
                num_reqs_padded=desc.num_reqs)[0])
        ids = torch.arange(1, desc.num_tokens + 1, dtype=torch.int32)  # vLLM slices its buffer
        out = r._model_forward(input_ids=ids, positions=ids.long())
        assert scope is None or scope.plan is None, "the forward consumes the step's plan"
        yield mode, desc, out


def _step(r, num_reqs: int, query_lens: list[int], *args, **kw):
    """`_in_step` with nothing after the forward."""
    with _in_step(r, num_reqs, query_lens, *args, **kw) as result:
        return result


class _PlanRecorder:
    """Stands in for our metadata builder: records what each build was planned for."""

    def __init__(self) -> None:
        self.planned = []

    def plan_for(self, context_bucket, max_query_len=None) -> None:
        self.planned.append((context_bucket, max_query_len))


def _mixed_graphs_on(r, token_buckets=(8, 16)):
    import dataclasses

    graphs = r.moe_graphs.graphs
    graphs.config = dataclasses.replace(graphs.config, mixed_graphs=True,
                                        token_buckets=token_buckets)
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, mixed_graphs=True)
