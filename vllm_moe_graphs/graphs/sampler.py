"""`SamplerGraphs`: `ops.sampling.sample` captured once per batch bucket, replayed after a step.

Shapes: R = the largest bucket (rows of the static buffers), V = vocabulary, n = a step's rows.

    sampler = SamplerGraphs(logits_buffer, vocab, buckets)   # [R, >= V] static logits
    sampler.stage(temperature, top_k, top_p, min_p)          # host arrays [n]: one H2D copy
    token_ids = sampler.run(logits, mask)                    # [n, 1] int32, a fresh tensor

Plan / run: `stage` writes the rows' parameters into a pinned host slot (rows n.. greedy
padding) and copies the slot to the device in one non-blocking copy; `run` copies the logits
into the static buffer unless they already are its leading rows (the decode graph's LM head
writes them there), lets `mask` edit those rows (a stop-token mask), replays the bucket's graph (captured on first use, after one eager run)
and returns a copy of the sampled tokens, so vLLM's asynchronous output copy and the next
step's replay never share memory. The pinned slots alternate and each waits for the event of
its last copy before it is rewritten: the host may run a step ahead of the device.

A graph reads only this object's static tensors (logits, parameters) and writes its token and
inexact-row counters; it holds no weight or KV address, so it survives a KV reallocation and is
dropped only with `drop()`. The noise is the default generator's (a capture registers it: each
replay draws afresh). Rows a graph sampled inexactly (`SampledTokens.exact`: ties of the k-th
logit spilling past the candidates) are counted on the device; `inexact_rows` reads the count
as of the last step's copy, without a sync. No vLLM import.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np
import torch

from vllm_moe_graphs.graphs.capture import CapturedGraph, CaptureFn, cuda_capture
from vllm_moe_graphs.ops.sampling import NUM_CANDIDATES, SamplingTensors, sample

_PARAMS = 4  # temperature, top_k, top_p, min_p: one float32 row each (top_k an exact integer)
_PADDING = (0.0, 1.0, 1.0, 0.0)  # a greedy row


class SamplerGraphs:
    """Sampling graphs per batch bucket over one static logits buffer (module docstring)."""

    def __init__(self, logits: torch.Tensor, vocab: int, buckets: Sequence[int], *,
                 capture_fn: CaptureFn | None = None) -> None:
        rows = logits.shape[0]
        if logits.dim() != 2 or not NUM_CANDIDATES <= vocab <= logits.shape[1]:
            raise ValueError(f"logits buffer must be [rows, >= vocab {vocab}] with a vocabulary "
                             f"of >= {NUM_CANDIDATES}, got {tuple(logits.shape)}")
        self.buckets = tuple(b for b in buckets if b <= rows)
        if not self.buckets:
            raise ValueError(f"no bucket of {list(buckets)} fits the buffer's {rows} rows")
        self.logits, self.vocab = logits, vocab
        device = logits.device
        self._cuda = device.type == "cuda"
        self._capture_fn = capture_fn or cuda_capture
        self._pool: object | None = None
        self._graphs: dict[int, CapturedGraph] = {}
        self._params = torch.empty(_PARAMS, rows, dtype=torch.float32, device=device)  # [4, R]
        self._host = torch.empty(2, _PARAMS, rows, dtype=torch.float32,
                                 pin_memory=self._cuda)  # [2, 4, R] pinned slots
        self._host_np = self._host.numpy()
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0
        self._staged = 0  # rows of the last `stage`
        self.tokens = torch.zeros(rows, 1, dtype=torch.int32, device=device)  # [R, 1]
        self._inexact = torch.zeros(1, dtype=torch.int64, device=device)
        self._inexact_host = torch.zeros(1, dtype=torch.int64, pin_memory=self._cuda)
        self.copied_in = 0  # steps whose logits were copied into the buffer (tests, diagnostics)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows` (None: more rows than the largest)."""
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @property
    def pool_bytes(self) -> int:
        """Bytes the live graphs' captures added to their pool (CUDA; 0 on emulation)."""
        return sum(graph.pool_bytes for graph in self._graphs.values())

    @property
    def inexact_rows(self) -> int:
        """Rows sampled inexactly so far, as of the last step's copy (no device sync)."""
        return int(self._inexact_host[0])

    @property
    def nbytes(self) -> int:
        """The static buffers this object allocated (the logits buffer is the caller's)."""
        return sum(t.numel() * t.element_size() for t in (self._params, self.tokens,
                                                          self._inexact))

    # -- plan ------------------------------------------------------------------------------------
    def stage(self, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
              min_p: np.ndarray | None) -> None:
        """Host side, before `run`: the n rows' parameters in vLLM's encoding (temperature 0:
        greedy; top_k = vocabulary when off; min_p None: 0 for every row)."""
        n = len(temperature)
        if not 0 < n <= self.max_rows:
            raise ValueError(f"{n} rows to stage, the sampler holds 1..{self.max_rows}")
        bucket = self.bucket(n)
        slot, self._slot = self._slot, 1 - self._slot
        if (event := self._copied[slot]) is not None:
            event.synchronize()  # the copy of two steps ago has long finished
        host = self._host_np[slot]  # [4, R]
        for i, values in enumerate((temperature, top_k, top_p, min_p)):
            if values is None:
                host[i, :n] = _PADDING[i]
            else:
                host[i, :n] = values[:n]
            host[i, n:bucket] = _PADDING[i]
        # the whole slot (4 x R floats, contiguous): rows past the bucket are never read
        self._params.copy_(self._host[slot], non_blocking=True)
        if self._cuda:
            self._copied[slot] = event = event or torch.cuda.Event()
            event.record()
        self._staged = n

    # -- run -------------------------------------------------------------------------------------
    def run(self, logits: torch.Tensor,
            mask: Callable[[torch.Tensor], object] | None = None) -> torch.Tensor:
        """Sample one token per row of `logits` [n, V] with the staged parameters; returns a
        new [n, 1] int32 tensor (vLLM's `SamplerOutput.sampled_token_ids`). `mask(view)`, if
        given, edits the buffer's rows [n, V] in place before the graph reads them (e.g. -inf
        over stop tokens: exact in any dtype)."""
        n = logits.shape[0]
        if n != self._staged or logits.dim() != 2 or logits.shape[1] != self.vocab:
            raise ValueError(f"logits {tuple(logits.shape)} do not match the {self._staged} "
                             f"staged rows over a vocabulary of {self.vocab}")
        bucket = self.bucket(n)
        if not _leading_rows(logits, self.logits):
            self.logits[:n, :self.vocab].copy_(logits)
            self.copied_in += 1
        if mask is not None:
            mask(self.logits[:n, :self.vocab])
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._capture(bucket)
        graph.replay()
        if self._cuda:
            self._inexact_host.copy_(self._inexact, non_blocking=True)
        else:
            self._inexact_host.copy_(self._inexact)
        self._staged = 0
        return self.tokens[:n].clone()

    def capture_all(self) -> int:
        """Capture every bucket not captured yet (start-up: no serving step waits for one);
        returns how many were captured. Greedy rows throughout: the draws are discarded."""
        done = 0
        for bucket in self.buckets:
            if bucket not in self._graphs:
                self._params[:, :bucket] = torch.tensor(_PADDING).unsqueeze(1)
                self._graphs[bucket] = self._capture(bucket)
                done += 1
        return done

    def drop(self) -> None:
        """Release every graph and the pool (a sleep or reload; the next use recaptures)."""
        for graph in self._graphs.values():
            graph.release()
        self._graphs.clear()
        self._pool = None

    # -- internals -------------------------------------------------------------------------------
    def _capture(self, bucket: int) -> CapturedGraph:
        """Capture `bucket`'s graph (not run: the caller replays it), after one eager run into
        a scratch counter (lazy inits; the step's rows are not counted twice)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle() if self._cuda else object()
        p = self._params[:, :bucket]
        params = SamplingTensors(temperature=p[0], top_k=p[1], top_p=p[2], min_p=p[3])
        logits, tokens = self.logits[:bucket, :self.vocab], self.tokens

        def fn(inexact: torch.Tensor) -> torch.Tensor:
            out = sample(logits, params)
            tokens[:bucket, 0].copy_(out.token_ids)
            inexact.add_((~out.exact).sum())
            return tokens[:bucket]

        fn(torch.zeros_like(self._inexact))
        return self._capture_fn(lambda: fn(self._inexact), self._pool, None, warm_up=False)


def _leading_rows(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """`view` is `buffer[:n, :V]` (the decode graph's LM head wrote the step's logits there)."""
    return (view.data_ptr() == buffer.data_ptr() and view.dtype == buffer.dtype
            and view.stride() == buffer.stride())
