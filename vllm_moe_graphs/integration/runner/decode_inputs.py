"""Pure-decode input preparation for vLLM 0.26's V1 `GPUModelRunner._prepare_inputs`.

vLLM's `_prepare_inputs` serves every batch shape (chunked prefill, speculative tokens,
M-RoPE, LoRA, context parallelism, hybrid models) and pays for it on every step: about twenty
small device operations (copies, an index, adds, fills, the slot-mapping Triton kernel) and as
many NumPy/CPU-tensor operations, 0.5 ms of host time per Qwen3-0.6B decode step on the H200
host (a `BENCH_PROFILE=1` phase profile, in git history). The host, not the GPU, bounds decode
there.

In a pure-decode step of a plain engine every request has one query token at position
`num_computed_tokens`, so everything the step needs follows on the host from two arrays vLLM
already keeps on the host (the computed-token counts and the block table). `DecodeInputs`
computes them with NumPy and moves them with five host-to-device copies (block table, query
start locations, positions, sequence lengths, slot mapping), writing exactly the values vLLM's
path writes into the buffers the rest of the step reads (the input ids come from last step's
sampled tokens on the device: one slice copy, or one scatter when rows moved):

buffer (vLLM name)                          | vLLM's path                     | here
------------------------------------------- | ------------------------------- | ----------------------------
block table (`commit_block_table`)          | host-to-device copy             | the same call
`input_ids.cpu`, `input_ids.gpu`            | index_select, `_prepare_input_ids` | NumPy gather, `_input_ids`
`query_start_loc` (cpu and gpu)             | cumsum, copy                    | arange, copy
`optimistic_seq_lens_cpu`                   | add                             | the same values
`prev_positions` (host)                     | `_compute_prev_positions`       | the same call
`discard_request_mask.np`                   | compare                         | the same compare
`positions[:n]`                             | index, cast, add on the GPU     | one copy
`seq_lens` (all rows, 0 past n)             | add, copy, fill on the GPU      | one copy
`slot_mapping.gpu` (-1 past n)              | Triton kernel                   | NumPy, one copy
logits indices                              | `query_start_loc[1:] - 1`       | `slice(0, n)`

Left unwritten: buffers that only speculative decoding, context parallelism or hybrid (Mamba)
models read (`req_indices`, `query_pos`, `num_scheduled_tokens`, `num_computed_tokens` and
`num_accepted_tokens` on the device, `discard_request_mask.gpu`); `DecodeInputs.unsupported`
refuses every engine with one of those features, and vLLM's own path rewrites them before it
reads them.

Per step the runner takes this path only for a pure-decode batch (one token per request, no
draft tokens, no prompt embeddings); any other step, and any engine `unsupported` names, runs
vLLM's `_prepare_inputs` unchanged. `tests/integration/runner/test_decode_inputs.py` runs a real CPU
engine through both and compares every buffer above, step by step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import vllm.envs as envs

PAD_SLOT_ID = -1  # vLLM's PAD_SLOT_ID: the KV write skips these rows


def unsupported(runner: Any) -> str | None:
    """Why this engine's steps cannot use `DecodeInputs` (None: they can)."""
    checks = (
        (runner.speculative_config is not None, "speculative decoding"),
        (runner.uses_mrope or runner.uses_xdrope_dim > 0, "M-RoPE / XD-RoPE positions"),
        (runner.enable_prompt_embeds, "prompt embeddings"),
        (bool(runner.lora_config), "LoRA"),
        (runner.cache_config.kv_sharing_fast_prefill, "kv_sharing_fast_prefill"),
        (runner.num_accepted_tokens_event is not None, "hybrid model accepted-token counts"),
        (runner.mamba_prev_last_scheduled_idx is not None
         or runner.cache_config.mamba_cache_mode == "align", "Mamba state"),
        (runner.dcp_world_size > 1 or getattr(runner, "pcp_world_size", 1) > 1,
         "context parallelism"),
    )
    for failed, what in checks:
        if failed:
            return what
    tables = runner.input_batch.block_table.block_tables
    if len(tables) != 1:
        return f"{len(tables)} KV cache groups"
    table = tables[0]
    if getattr(table.slot_mapping_mode, "name", "") != "TOKEN_TO_KV_SLOT":
        return f"slot mapping mode {table.slot_mapping_mode}"
    if table.blocks_per_kv_block != 1:
        return f"{table.blocks_per_kv_block} kernel blocks per KV block"
    return None


def pure_decode(runner: Any, scheduler_output: Any) -> bool:
    """One query token per request, no draft tokens, no prompt embeddings."""
    return (scheduler_output.total_num_scheduled_tokens == runner.input_batch.num_reqs
            and not scheduler_output.scheduled_spec_decode_tokens
            and not runner.input_batch.req_prompt_embeds)


class DecodeInputs:
    """Host staging for one runner's pure-decode steps (see the module docstring)."""

    def __init__(self, runner: Any) -> None:
        pin = runner.device.type == "cuda"
        n = runner.max_num_reqs
        self._positions = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._seq_lens = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        # scatter indices of the input ids (rows now, rows last step): pinned host staging, and
        # device rows allocated at first use (a step, never inside the sleep-mode pool)
        self._dst = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._src = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._dst_dev: torch.Tensor | None = None
        self._src_dev: torch.Tensor | None = None
        self._device = runner.device
        self._qsl_fill = np.arange(n + 1, dtype=np.int32)
        self._optimistic = runner.optimistic_seq_lens_cpu.numpy()
        self.steps = 0  # steps prepared here (tests, diagnostics)

    def prepare(self, runner: Any, scheduler_output: Any) -> tuple[slice, None]:
        """`_prepare_inputs` for a pure-decode step (caller checked `pure_decode`): returns
        (logits indices, no speculative metadata), as vLLM's does; the indices as a slice."""
        batch = runner.input_batch
        n = batch.num_reqs
        table = batch.block_table.block_tables[0]
        # The block table first: its copy overlaps the host work below (as vLLM orders it).
        batch.block_table.commit_block_table(n)

        computed = batch.num_computed_tokens_cpu[:n]  # = each request's one position
        rows = runner.arange_np[:n]
        runner.input_ids.np[:n] = batch.token_ids_cpu[rows, computed]

        qsl = runner.query_start_loc.np
        qsl[:n + 1] = self._qsl_fill[:n + 1]
        qsl[n + 1:] = n
        runner.query_start_loc.copy_to_gpu()

        seq_lens = self._seq_lens.numpy()
        np.add(computed, 1, out=seq_lens[:n])
        seq_lens[n:] = 0
        self._optimistic[:] = seq_lens
        runner._compute_prev_positions(n)
        num_tokens = np.fromiter((runner.requests[r].num_tokens for r in batch.req_ids),
                                 dtype=np.int64, count=n)
        runner.discard_request_mask.np[:n] = seq_lens[:n] < num_tokens

        self._positions.numpy()[:n] = computed
        runner.positions[:n].copy_(self._positions[:n], non_blocking=True)
        runner.seq_lens.copy_(self._seq_lens, non_blocking=True)

        size = table.block_size
        slots = table.slot_mapping.np
        blocks = table.block_table.np[rows, computed // size].astype(np.int64)
        np.add(blocks * size, computed % size, out=slots[:n])
        slots[n:] = PAD_SLOT_ID
        table.slot_mapping.copy_to_gpu()

        self._input_ids(runner, n)
        self.steps += 1
        # NOTE: a slice, not vLLM's index tensor: its one use on this path,
        # `hidden_states[logits_indices]` in execute_model, then takes a view of rows 0..n-1
        # (query token i is request i's) instead of launching an index kernel, and
        # `graph_logits.GraphLogits` recognises that view. Its other readers, speculative
        # decoding and kv_sharing_fast_prefill, are refused by `unsupported`.
        return slice(0, n), None

    def _input_ids(self, runner: Any, n: int) -> None:
        """vLLM's `_prepare_input_ids` for a pure-decode step, without its per-request Python
        loop (142 us at batch 64 on the H200 host): with async scheduling the tokens sampled
        last step are still on the GPU (`prev_sampled_token_ids`) and go into `input_ids.gpu`
        by one slice copy when every request kept its row, by one scatter otherwise; the host
        copy serves new requests. Row i's query token is row i (one token per request), which
        is what makes the index arithmetic a NumPy compare."""
        prev_tokens = runner.input_batch.prev_sampled_token_ids
        if prev_tokens is None:  # synchronous scheduling: the host has every token
            runner.input_ids.copy_to_gpu(n)
            return
        prev = runner.prev_positions.np[:n]  # row -> row last step, -1 for a new request
        common = prev >= 0
        k = int(np.count_nonzero(common))
        if k < n:
            runner.input_ids.copy_to_gpu(n)
        if k == 0:
            return
        rows = runner.arange_np[:n]
        if bool((prev[:k] == rows[:k]).all()):
            # rows 0..k-1 are the k surviving requests, each in last step's row (vLLM's
            # "batch unchanged, no reordering" case)
            runner.input_ids.gpu[:k].copy_(prev_tokens[:k, 0], non_blocking=True)
            return
        # Rows moved (a finished request's row was refilled): scatter. The index pairs go
        # through pinned staging rows, reused like the position and length rows above (vLLM
        # waits for the previous step's copies before it prepares the next step).
        self._dst.numpy()[:k] = rows[common]
        self._src.numpy()[:k] = prev[common]
        if self._dst_dev is None:
            self._dst_dev = torch.empty_like(self._dst, device=self._device)
            self._src_dev = torch.empty_like(self._src, device=self._device)
        dst, src = self._dst_dev[:k], self._src_dev[:k]
        dst.copy_(self._dst[:k], non_blocking=True)
        src.copy_(self._src[:k], non_blocking=True)
        runner.input_ids.gpu.scatter_(0, dst, prev_tokens[src, 0])

    def bookkeeping(self, runner: Any, sampler_output: Any) -> tuple[Any, ...] | None:
        """vLLM's `_bookkeeping_sync` for a pure-decode step under async scheduling, with its
        per-request loops as NumPy (144 us at batch 64 on the H200 host); None when
        the step is not that case (the caller then runs vLLM's). Writes what vLLM's writes: the
        placeholder token (-1) of every kept request into the host token table, its count, and
        the request's output ids; last step's sampled tokens and row map for the next step."""
        sampled = sampler_output.sampled_token_ids
        batch = runner.input_batch
        n = batch.num_reqs
        if (not runner.use_async_scheduling or sampled.dim() != 2 or sampled.shape[-1] != 1
                or sampled.shape[0] != n or runner.num_prompt_logprobs
                or envs.VLLM_COMPUTE_NANS_IN_LOGITS):
            return None
        discard = np.flatnonzero(runner.discard_request_mask.np[:n])
        for i in discard:
            gen = batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        req_ids = batch.req_ids
        req_ids_copy, index_copy = req_ids.copy(), batch.req_id_to_index.copy()
        invalid = discard.tolist()
        if batch.prev_sampled_token_ids is None:
            batch.prev_sampled_token_ids = sampled
        rows = runner.arange_np[:n]
        if invalid:
            keep = np.ones(n, dtype=bool)
            keep[discard] = False
            rows = rows[keep]
            batch.prev_req_id_to_index = {req_ids[i]: i for i in rows.tolist()}
        else:
            batch.prev_req_id_to_index = dict(zip(req_ids, range(n)))
        start = batch.num_tokens_no_spec[rows]
        if rows.size and int(start.max()) + 1 > runner.max_model_len:
            raise AssertionError(
                "Sampled token IDs exceed the max model length. Total number of tokens: "
                f"{int(start.max()) + 1} > max_model_len: {runner.max_model_len}")
        batch.token_ids_cpu[rows, start] = -1
        batch.is_token_ids[rows, start] = True
        batch.num_tokens_no_spec[rows] = start + 1
        requests = runner.requests
        for i in rows.tolist():
            requests[req_ids[i]].output_token_ids.append(-1)
        # (nans in logits, logprobs lists, valid sampled ids, prompt logprobs, req ids,
        #  req id -> index, invalid rows): vLLM's return, async scheduling
        return {}, None, [], {}, req_ids_copy, index_copy, invalid

