"""`graph_logits`: which logits processors the decode graph may absorb, and (on the GPU) that
the in-graph LM head computes vLLM's logits bit for bit.

The per-step hand-over (warm-up, capture, replay, fallbacks) is tested on the runner in
`test_override_steps.py`; the engine-level proof is the GPU parity tier (graphs against the
kill switch's eager steps, where vLLM computes the logits)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm.model_executor.layers.logits_processor")

from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    UnquantizedEmbeddingMethod,
)

from vllm_moe_graphs.integration.model import graph_logits  # noqa: E402


def _model(lp=None, **head):
    weight = torch.zeros(8, 4, dtype=torch.bfloat16)
    lm_head = types.SimpleNamespace(quant_method=UnquantizedEmbeddingMethod(), weight=weight,
                                    bias=None)
    for k, v in head.items():
        setattr(lm_head, k, v)
    return types.SimpleNamespace(logits_processor=lp or LogitsProcessor(8), lm_head=lm_head,
                                 compute_logits=lambda h: "vLLM's")


@pytest.fixture
def tp(monkeypatch):
    """A settable TP world size, and no vLLM config for LogitsProcessor to read (no engine)."""
    import vllm.distributed
    import vllm.model_executor.layers.logits_processor as lp_module

    size = {"n": 1}
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size",
                        lambda: size["n"])
    monkeypatch.setattr(lp_module, "get_current_vllm_config",
                        lambda: types.SimpleNamespace(model_config=None))
    return size


def test_plain_logits_processor_is_supported(tp):
    assert graph_logits.unsupported(_model()) is None


class _Subclass(LogitsProcessor):
    pass


@pytest.mark.parametrize("case, reason", [
    ("soft_cap", "soft cap"),
    ("scale", "soft cap, scale"),
    ("logits_as_input", "logits_as_input"),
    ("subclass", "logits processor _Subclass"),
    ("quantized", "quantized or missing LM head"),
    ("bias", "LM head bias"),
    ("head_dtype", "head dtype torch.float32"),
    ("tp", "tensor parallelism"),
])
def test_anything_else_stays_with_vllm(tp, case, reason):
    lp = _Subclass(8) if case == "subclass" else LogitsProcessor(8)
    head = {}
    if case == "soft_cap":
        lp.soft_cap = 30.0
    elif case == "scale":
        lp.scale = 0.5
    elif case == "logits_as_input":
        lp.logits_as_input = True
    elif case == "quantized":
        head["quant_method"] = object()
    elif case == "bias":
        head["bias"] = torch.zeros(8)
    elif case == "head_dtype":
        lp.head_dtype = torch.float32
    elif case == "tp":
        tp["n"] = 2
    why = graph_logits.unsupported(_model(lp, **head))
    assert why is not None and reason in why, why


class _Graphs:
    """What install_graph_logits reads and writes of a DecodeGraphRunner."""

    def __init__(self, buckets):
        self.config = types.SimpleNamespace(decode_batch_buckets=buckets)
        self.scratch_bytes = 100

    def set_scratch_bytes(self, n):
        self.scratch_bytes = n


def test_install_sizes_the_buffer_to_the_buckets_and_counts_it_as_scratch(tp):
    model = _model()
    graphs = _Graphs((1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128))
    logits = graph_logits.install_graph_logits(model, graphs)
    assert logits.buffer.shape == (graph_logits.MAX_ROWS, 8)  # capped at 64 rows
    assert graphs.scratch_bytes == 100 + logits.nbytes == 100 + 64 * 8 * 2
    assert model.compute_logits == logits._compute_logits
    assert graph_logits.install_graph_logits(_model(), _Graphs((1, 2, 4))).buffer.shape[0] == 4
    model.logits_processor.soft_cap = 30.0
    untouched = _Graphs((1, 2))
    assert graph_logits.install_graph_logits(model, untouched) is None
    assert untouched.scratch_bytes == 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hidden", [1024, 2048, 4096])
def test_gpu_graph_logits_match_compute_logits(hidden):
    """`GraphLogits.compute` (torch.mm into the static buffer, replayed from a CUDA graph)
    against what vLLM's LM head runs on CUDA (`F.linear`): equal bit for bit, every row count
    of a batch bucket up to 64, Qwen3's vocabulary (151936)."""
    torch.manual_seed(0)
    vocab, dev = 151936, "cuda"
    weight = (torch.randn(vocab, hidden, device=dev) * 0.02).to(torch.bfloat16)
    lm = types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=weight),
                               logits_processor=types.SimpleNamespace(org_vocab_size=vocab),
                               compute_logits=lambda h: torch.nn.functional.linear(h, weight))
    gl = graph_logits.GraphLogits(lm, graph_logits.MAX_ROWS)
    for rows in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        hidden_states = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        static = hidden_states.clone()
        gl.compute(static)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            gl.compute(static)
        static.copy_(torch.randn_like(static))
        graph.replay()
        gl.hand_over(static, rows)
        ours = lm.compute_logits(static[slice(0, rows)])
        ref = torch.nn.functional.linear(static, weight)
        assert ours.data_ptr() == gl.buffer.data_ptr() and ours.shape == (rows, vocab)
        assert torch.equal(ours, ref), (rows, (ours.float() - ref.float()).abs().max().item())
