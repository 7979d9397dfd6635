"""The LM head inside the decode graph (`logits_in_graph`).

vLLM 0.26's V1 runner computes a step's logits after the forward, on the host's time:

    sample_hidden_states = hidden_states[logits_indices]       # an index kernel
    logits = self.model.compute_logits(sample_hidden_states)   # LogitsProcessor -> F.linear

On the H200 host that is about 0.15 ms of Python and launches per decode step (a step
profile: the index 80 us, the LM head's linear 67-79 us), and a Qwen3-0.6B step at batch 8 is
host-bound. `GraphLogits` moves both into the step's forward, i.e. into the captured graph:

- `compute(hidden)`, called at the end of the decode forward (eager warm-up, capture), writes
  `hidden @ lm_head.weight.T` into one static buffer `[max_rows, padded vocab]` with `torch.mm`
  and `out=` (the kernel `F.linear` runs for a 2-D input without bias, so the values are
  vLLM's, bit for bit; `test_gpu_graph_logits_match_compute_logits` checks it on the GPU);
- `hand_over(hidden, rows)` after the step's forward: `compute_logits` of the same step, given
  exactly that hidden-state view, returns `buffer[:rows, :vocab]` instead of computing again;
  any other call (prefill, dummy runs, eager fallbacks) runs vLLM's own `compute_logits`;
- the pure-decode step's logits indices are `slice(0, n)` (`DecodeInputs.prepare`), so
  `hidden_states[logits_indices]` is a view of the same rows (no index kernel) and the view
  check above holds.

The buffer is static (outside the graph pool, counted as scratch): every bucket's graph writes
the same rows, so the pool does not grow with the number of buckets. It is reused by the next
step; vLLM's sampler reads it (and may modify it in place) in `sample_tokens`, which runs on
the same stream before the next step's forward.

Installed only when the logits processor is vLLM's plain one: unquantized LM head, no soft cap,
scale 1, no head dtype change, tensor parallel size 1 (`unsupported` names the first that
fails; the engine then computes logits as vLLM does).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from vllm_moe_graphs.integration.patch import compute_logits

if TYPE_CHECKING:
    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner

logger = logging.getLogger("vllm.moe_graphs")

# Rows of the static logits buffer: batch buckets up to this many compute their logits inside
# the graph (64 x Qwen3's 151936 vocab in bfloat16: 19 MiB); larger batches are GPU-bound, where
# the host time saved matters less than the memory.
MAX_ROWS = 64


def unsupported(model: Any) -> str | None:
    """Why `model`'s logits cannot be computed inside the decode graph (None: they can)."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    lp, head = getattr(model, "logits_processor", None), getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    checks = (
        (type(lp) is not LogitsProcessor, f"logits processor {type(lp).__name__}"),
        (not isinstance(getattr(head, "quant_method", None), UnquantizedEmbeddingMethod),
         "quantized or missing LM head"),
        (not isinstance(weight, torch.Tensor) or weight.dim() != 2, "LM head weight not 2-D"),
        (getattr(lp, "logits_as_input", True) or getattr(lp, "soft_cap", 1.0) is not None
         or getattr(lp, "scale", 0.0) != 1.0, "logits soft cap, scale or logits_as_input"),
        (getattr(head, "bias", None) is not None, "LM head bias"),
        (get_tensor_model_parallel_world_size() != 1, "tensor parallelism"),
    )
    for failed, what in checks:
        if failed:
            return what
    if lp.head_dtype is not None and lp.head_dtype != weight.dtype:
        return f"head dtype {lp.head_dtype} (model {weight.dtype})"
    return None


def install_graph_logits(model: Any, graphs: DecodeGraphRunner) -> GraphLogits | None:
    """A `GraphLogits` for `model`, sized to the graphs' batch buckets (at most MAX_ROWS), its
    buffer counted in the graphs' scratch bytes; None (logged why) when `unsupported`."""
    if (why := unsupported(model)) is not None:
        logger.info("moe_graphs: logits computed by vLLM (%s)", why)
        return None
    rows = min(MAX_ROWS, graphs.config.decode_batch_buckets[-1])
    logits = GraphLogits(model, rows)
    graphs.set_scratch_bytes(graphs.scratch_bytes + logits.nbytes)
    logger.info("moe_graphs: logits computed inside the decode graphs (logits_in_graph, batch "
                "buckets <= %d, %.1f MiB static buffer)", rows, logits.nbytes / (1 << 20))
    return logits


class GraphLogits:
    """The static logits of a decode step, computed inside its forward (module docstring)."""

    def __init__(self, model: Any, max_rows: int) -> None:
        weight = model.lm_head.weight  # [padded vocab, hidden]
        self._vocab = int(model.logits_processor.org_vocab_size)
        # NOTE: allocated when the serving KV cache is set up (inside vLLM's sleep-mode pool when
        # that is on): a sleep may discard its contents, which every step rewrites first.
        self.buffer = torch.empty(max_rows, weight.shape[0], dtype=weight.dtype,
                                  device=weight.device)
        self._model = model
        self._handed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.handed_over = 0  # steps whose logits came from the forward (tests, diagnostics)
        # the bound method vLLM's runner calls, shadowed for this model object only
        self._stock = compute_logits.install(model, self._compute_logits)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def compute(self, hidden: torch.Tensor) -> None:
        """Inside the forward (and so inside a capture): logits of every row of `hidden`."""
        # the weight as the model holds it now (a reload may replace the tensor; the graphs
        # captured before are dropped then, and the next capture reads the new one)
        weight = self._model.lm_head.weight
        torch.mm(hidden, weight.t(), out=self.buffer[:hidden.shape[0]])

    def hand_over(self, hidden: torch.Tensor, rows: int) -> None:
        """The step's forward wrote logits for `hidden` (its first `rows` rows are real)."""
        self._handed = (hidden, self.buffer[:rows, :self._vocab])

    def clear(self) -> None:
        self._handed = None

    def uninstall(self) -> None:
        self._handed = None
        compute_logits.uninstall(self._model, self._compute_logits)

    def _compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        handed, self._handed = self._handed, None
        if handed is not None and not args and not kwargs and _same_view(hidden_states,
                                                                         handed[0]):
            self.handed_over += 1
            return handed[1]
        return self._stock(hidden_states, *args, **kwargs)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same rows of the same storage (vLLM's `hidden_states[slice(0, n)]` of our output)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)
