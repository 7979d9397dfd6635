"""Tensor-parallel ranks run the same kind of decode step (not wired in yet: tensor parallelism is not supported).

Each rank decides its decode step from its own host state (`DecodeGraphRunner.decide`). Under
tensor parallelism the ranks' forwards all-reduce together, so they must run the same thing:
the same action and the same number of rows. A rank replaying an 8-row graph while another runs
5 rows eager all-reduces tensors of different sizes (a hang, or garbage); a rank that captures
runs its forward more than once (the capture, a warm-up run before it where the key had no eager
step, then the replay) where a replaying rank runs it once. Yet the ranks' local state can
differ for a step: each process reads the kill file on its own clock (up to 100 ms stale), a
capture can fail on one rank only (quarantine), pool sizes and hence the memory budget can
differ.

So before a step every rank shares what its decision would run (`execution`, five ints) with
the other ranks (`RankExchange`, one all-gather over the tensor-parallel group's CPU/gloo
group), and every rank applies `agree` to the same gathered list: when all ranks would run the
same thing, each keeps its own decision (its own fallback reason, for its own metrics); when
they differ, every rank runs the step eager and unpadded with `Reason.RANK_DISAGREEMENT`. A
disagreeing step advances no warm-up counter on any rank, so the ranks' counters stay equal.

Pure logic plus a thin transport; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.graphs.runner import Action, Decision

_ACTION_CODE = {Action.REPLAY: 0, Action.CAPTURE: 1, Action.EAGER: 2}

Execution = tuple[int, int, int, int, int]


def execution(d: Decision) -> Execution:
    """What a decision makes the forward do, as ints every rank must agree on: (action, rows
    the forward runs on, batch bucket, context bucket, real rows). The key counts only where it
    selects a graph; eager fallbacks with different reasons run the same forward."""
    graph = d.action is not Action.EAGER
    return (_ACTION_CODE[d.action], d.batch_size,
            d.key.batch_bucket if graph and d.key else 0,
            d.key.context_bucket if graph and d.key else 0, d.num_reqs)


def agree(local: Decision, gathered: Sequence[Sequence[int]]) -> Decision:
    """The decision this rank runs, given every rank's `execution` (this rank's included).

    Raises RuntimeError when the ranks were given different batches (different real row
    counts): that is a scheduler-level divergence no per-step fallback can repair."""
    rows = [tuple(int(v) for v in g) for g in gathered]
    if not rows:
        raise ValueError("agree() needs at least this rank's execution")
    mine = execution(local)
    if mine not in rows:
        raise ValueError(f"this rank's execution {mine} is not among the gathered {rows}")
    if len({r[4] for r in rows}) != 1:
        raise RuntimeError(f"tensor-parallel ranks were given different batches (real rows "
                           f"{[r[4] for r in rows]}); graphs cannot paper over this")
    if all(r == mine for r in rows):
        return local
    return Decision(Action.EAGER, local.key, Reason.RANK_DISAGREEMENT, local.num_reqs)


class RankExchange:
    """All-gathers each rank's `execution` over a torch.distributed CPU (gloo) group."""

    def __init__(self, group: object | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.world_size = dist.get_world_size(group)
        self._mine = torch.zeros(5, dtype=torch.int64)
        self._all = [torch.zeros(5, dtype=torch.int64) for _ in range(self.world_size)]

    def gather(self, row: Execution) -> list[Execution]:
        self._mine.copy_(torch.tensor(row, dtype=torch.int64))
        self._dist.all_gather(self._all, self._mine, group=self._group)
        return [tuple(int(v) for v in t.tolist()) for t in self._all]

    def decide(self, local: Decision) -> Decision:
        """`agree(local, gather(execution(local)))`; a no-op round trip for one rank."""
        if self.world_size == 1:
            return local
        return agree(local, self.gather(execution(local)))
