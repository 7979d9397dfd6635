"""Host cost of the per-batch decision (it must cost little CPU).

    python -m benchmarks.decide_cost [--layers 48] [--iterations 200000]

Times, on this machine's CPU, what `MoeGraphsModelRunner` adds to one decode step before the
replay: the KV-swap check (one identity comparison per attention layer), `DecodeGraphRunner.
decide()` for a live graph (bucket lookup, kill switch, storage owner/generation/proof gate), and
the per-step metrics increment (prometheus multiprocess value). No GPU, no vLLM engine: the
storage is bound to real CPU tensors of the Qwen3-30B-A3B layer count. Prints microseconds per
step for each part and in total.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import types

import torch

from vllm_moe_graphs.config import PluginConfig
from vllm_moe_graphs.graphs.runner import CapturedGraph, DecodeGraphRunner
from vllm_moe_graphs.killswitch import KillSwitch
from vllm_moe_graphs.kv.storage import PagedKVStorage, Phase


def _per_call_us(fn, iterations: int) -> float:
    for _ in range(min(1000, iterations)):
        fn()
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - t0) / iterations * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--iterations", type=int, default=200_000)
    args = p.parse_args(argv)

    os.environ.setdefault("MOE_GRAPHS_METRICS_DIR", tempfile.mkdtemp(prefix="decide-cost-"))
    from vllm_moe_graphs.metrics import recorder

    rec = recorder(0)
    layers = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 4, 16, 256)
              for i in range(args.layers)}
    storage = PagedKVStorage(metrics=rec)
    storage.bind(layers, phase=Phase.SERVING)
    storage.check_devices("cpu", "cpu")
    watch = tuple((types.SimpleNamespace(kv_cache=t), t) for t in layers.values())
    out = torch.zeros(8, 1)

    def capture(fn, pool, before):
        return CapturedGraph(lambda: None, out, 0)

    kill = KillSwitch(os.path.join(tempfile.gettempdir(), "decide-cost-no-such-file"))
    runner = DecodeGraphRunner(lambda b: out, PluginConfig(warmup_steps=0), storage=storage,
                               kill_switch=kill, metrics=rec, capture_fn=capture, new_pool=object)
    runner.run(7, 600, True)  # captures GraphKey(8, 2048)
    assert runner.decide(7, 600, True).action.value == "replay"

    parts = {
        "kv swap check": lambda: any(layer.kv_cache is not t for layer, t in watch),
        "decide (replay)": lambda: runner.decide(7, 600, True),
        "metrics replay()": lambda: rec.replay(),
    }
    print(f"per decode step, {args.layers} attention layers, {args.iterations} iterations "
          f"(torch {torch.__version__}, {os.cpu_count()} CPUs):")
    total = 0.0
    for name, fn in parts.items():
        us = _per_call_us(fn, args.iterations)
        total += us
        print(f"  {name:<18} {us:7.2f} us")
    print(f"  {'total':<18} {total:7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
