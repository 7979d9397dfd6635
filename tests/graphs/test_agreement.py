"""Tensor-parallel agreement on the decode step (`graphs/agreement.py`): the pure rule,
then the real exchange between two processes over a gloo group (CPU, torch.distributed)."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.graphs.agreement import RankExchange, agree, execution
from vllm_moe_graphs.graphs.buckets import GraphKey
from vllm_moe_graphs.graphs.runner import Action, Decision

K8 = GraphKey(8, 2048)


def replay(rows=5, key=K8):
    return Decision(Action.REPLAY, key, Reason.ELIGIBLE, rows)


def capture(rows=5):
    return Decision(Action.CAPTURE, K8, Reason.ELIGIBLE, rows)


def warmup(rows=5):
    return Decision(Action.EAGER, K8, Reason.ELIGIBLE, rows)


def eager(reason, rows=5, key=K8):
    return Decision(Action.EAGER, key, reason, rows)


def test_execution_is_what_the_forward_runs():
    assert execution(replay()) == (0, 8, 8, 2048, 5)      # padded to the bucket, graph by key
    assert execution(capture()) == (1, 8, 8, 2048, 5)
    assert execution(warmup()) == (2, 8, 0, 0, 5)         # eager, but padded to the bucket
    assert execution(eager(Reason.KILL_SWITCH)) == (2, 8, 0, 0, 5)  # eager, the key's shape
    assert execution(eager(Reason.STORAGE_IDENTITY_CHANGED)) == (2, 5, 0, 0, 5)  # real rows


def test_same_execution_keeps_each_ranks_own_decision():
    # two fallbacks with different reasons run the same forward: each rank keeps its reason
    a, b = eager(Reason.KILL_SWITCH), eager(Reason.MEMORY_BUDGET)
    gathered = [execution(a), execution(b)]
    assert agree(a, gathered) is a and agree(b, gathered) is b
    r = replay()
    assert agree(r, [execution(r)] * 4) is r


@pytest.mark.parametrize("mine, other", [
    (replay(), eager(Reason.KILL_SWITCH)),    # kill file seen by one rank first
    (replay(), capture()),                    # one rank lost its graph (dropped, recapturing)
    (capture(), eager(Reason.CAPTURE_FAILED)),  # the key is quarantined on one rank only
    (warmup(), eager(Reason.STORAGE_IDENTITY_CHANGED)),  # padded warm-up vs unpadded
    (replay(), replay(key=GraphKey(8, 8192))),  # another context bucket: another graph
], ids=["kill-file", "replay-vs-capture", "quarantine", "warmup-vs-storage", "context-bucket"])
def test_any_difference_makes_every_rank_run_eager_unpadded(mine, other):
    gathered = [execution(mine), execution(other)]
    for local in (mine, other):
        d = agree(local, gathered)
        assert d.action is Action.EAGER and d.reason is Reason.RANK_DISAGREEMENT
        assert d.batch_size == local.num_reqs == 5 and not d.warming_up
    # and all ranks now run the very same thing
    assert execution(agree(mine, gathered)) == execution(agree(other, gathered))


def test_different_batches_are_refused_not_papered_over():
    with pytest.raises(RuntimeError, match=r"different batches \(real rows \[5, 6\]\)"):
        agree(replay(5), [execution(replay(5)), execution(replay(6))])
    with pytest.raises(ValueError, match="not among the gathered"):
        agree(replay(5), [execution(capture(5))])
    with pytest.raises(ValueError, match="at least this rank"):
        agree(replay(5), [])


# ---------------------------------------------------------------------------- two processes

# rank -> the decision it reaches on its own, per step
_STEPS = [
    (replay(), replay()),                          # agree: both replay
    (replay(), eager(Reason.KILL_SWITCH)),         # rank 1 saw the kill file first
    (eager(Reason.KILL_SWITCH), eager(Reason.KILL_SWITCH)),
    (capture(), eager(Reason.CAPTURE_FAILED)),
]


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        exchange = RankExchange()
        ran = [exchange.decide(step[rank]) for step in _STEPS]
        results.put((rank, [execution(d) + (d.reason.value,) for d in ran]))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_reach_the_same_execution_over_gloo():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    rank0, rank1 = got[0], got[1]
    assert [r[:5] for r in rank0] == [r[:5] for r in rank1]  # same forward on both, every step
    assert [r[5] for r in rank0] == ["eligible", "rank_disagreement", "kill_switch",
                                     "rank_disagreement"]
    assert rank0[0][0] == 0 and rank0[1][:2] == (2, 5)  # replay, then eager on the 5 real rows


def test_one_rank_exchange_is_a_no_op():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        d = replay()
        assert RankExchange().decide(d) is d
    finally:
        dist.destroy_process_group()

