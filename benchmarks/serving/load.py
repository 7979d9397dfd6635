"""Open-loop load for `benchmarks.serving`: seeded workloads, Poisson arrivals, streamed completions
sent by several client processes, and the statistics of what they saw.

A window offers R requests at `rate` requests/s. Every mode gets the same requests: arrival times,
prompt token ids and output lengths come from a seed, the workload name and the rate. Each
request is a streamed `/v1/completions` call with a token-id prompt, `ignore_eos` and
`max_tokens = min_tokens`, so every mode produces the same number of tokens. The server streams
`usage` with every chunk (`continuous_usage_stats`), so a chunk's token count is exact even when
vLLM merges several steps' tokens into one chunk.

Timing (all from one system-wide monotonic clock, so client processes agree):
  send lag = sent - scheduled   (the client's own delay; > 10 ms at p99 means the client lags)
  TTFT     = first token chunk - sent
  TPOT     = (last token chunk - first token chunk) / (output tokens - 1), per request
  ITL      = gaps between consecutive token chunks, pooled over requests
  E2E      = last token chunk - sent
Throughput divides the tokens (requests) completed by the time from the window's start to its
last completion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from benchmarks.harness.sampling import QWEN3_CHAT_SAMPLING
from benchmarks.harness.stats import percentile

LAG_P99_LIMIT_MS = 10.0  # client send lag above this at p99 marks a window's client as lagging
TOKEN_ID_FLOOR = 1000  # prompt ids start here: clear of the special tokens at the vocab's start
START_LEAD_S = 0.5  # the window starts this long after the clients were handed their requests
SPIN_S = 0.003  # a request's last wait before its send time is a yielding spin, not a timer
_USAGE_RE = re.compile(rb'"completion_tokens":\s*(\d+)')


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompt_len: tuple[int, int]  # inclusive range, uniform
    output_len: tuple[int, int]  # inclusive range, uniform
    description: str
    server: str = "default"  # the server it needs: "default" or "moe_offload"
    # sampling parameters of every request over greedy (temperature 0), as (name, value) pairs
    sampling: tuple[tuple[str, float], ...] = ()
    # the greedy workload of the same lengths it samples over: what its sampling costs is read
    # against that one's rows (report.sampling_costs)
    greedy_twin: str | None = None


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("chat", (128, 1024), (128, 256),
                 "prompts of 128-1024 tokens, 128-256 output tokens"),
        # NOTE: unseeded, as clients send it; the numbers and why: harness/sampling.py.
        Workload("chat_sampled", (128, 1024), (128, 256),
                 "chat prompts and lengths, sampled as Qwen3's model card advises for chat "
                 "(temperature 0.7, top-p 0.8, top-k 20)",
                 sampling=QWEN3_CHAT_SAMPLING, greedy_twin="chat"),
        Workload("long", (4096, 8192), (128, 128),
                 "prompts of 4096-8192 tokens (chunked prefill splits them over several steps), "
                 "128 output tokens"),
        # NOTE: every step reads its routed experts of the offloaded layers over PCIe (29 GB of
        # Qwen3-30B-A3B's 58 GB of experts by default): at about 50 GB/s a decode step of 1-8
        # requests would take 0.04-0.3 s, so outputs are short and the default rates low.
        Workload("moe_offload", (128, 1024), (32, 64),
                 "chat prompts, 32-64 output tokens, on a server that keeps MoE experts in "
                 "host memory (vLLM's UVA offload: --cpu-offload-gb N --cpu-offload-params "
                 "experts)", server="moe_offload"),
    )
}


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    index: int
    at_s: float  # scheduled send time, seconds after the window's start
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    sampling: tuple[tuple[str, float], ...] = ()  # its workload's, over greedy


@dataclasses.dataclass(slots=True)
class Record:
    """What one request saw; times in seconds after the window's start."""

    index: int
    prompt_len: int
    scheduled_s: float
    max_tokens: int
    sent_s: float = math.nan
    chunk_s: list[float] = dataclasses.field(default_factory=list)  # chunks that carried tokens
    output_tokens: int = 0
    error: str | None = None


def parse_workloads(names: Sequence[str]) -> list[Workload]:
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; "
                         f"known: {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in dict.fromkeys(names)]


def rate_label(rate: float) -> str:
    """`r16`, `r0.5`: the rate part of a ratio key."""
    return "r" + (str(int(rate)) if float(rate).is_integer() else f"{rate:g}")


def window_requests(rate: float, duration_s: float, min_requests: int) -> int:
    """How many requests a window offers: max(min_requests, rate * duration_s)."""
    return max(min_requests, round(rate * duration_s))


def plan_window(workload: Workload, rate: float, duration_s: float, min_requests: int,
                seed: int, vocab_size: int) -> list[Request]:
    """The requests of one window: max(min_requests, rate * duration_s) Poisson arrivals.

    Deterministic in (seed, workload, rate): every mode is offered the same requests, however
    its rate was spelled (`2`, `2.0`)."""
    if rate <= 0 or duration_s <= 0 or min_requests < 1:
        raise ValueError(f"rate, duration and min_requests must be positive, got rate={rate} "
                         f"duration_s={duration_s} min_requests={min_requests}")
    if vocab_size < 8:
        raise ValueError(f"vocab_size {vocab_size} too small for random prompts")
    rng = random.Random(f"{seed}/{workload.name}/{float(rate):g}")
    ids = range(min(TOKEN_ID_FLOOR, vocab_size // 4), vocab_size)
    n = window_requests(rate, duration_s, min_requests)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = tuple(rng.choices(ids, k=rng.randint(*workload.prompt_len)))
        out.append(Request(i, t, prompt, rng.randint(*workload.output_len), workload.sampling))
    return out


def _body(model: str, req: Request) -> bytes:
    return json.dumps({
        "model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
        "min_tokens": req.max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **dict(req.sampling),
    }).encode()


async def _one(session: Any, url: str, body: bytes, t0: float, rec: Record) -> None:
    # Sleep to SPIN_S before the send time, then yield in a loop until it: a timer wake-up
    # from an idle loop (and an idle core) lands milliseconds late, a yielding spin does not.
    target = t0 + rec.scheduled_s
    if (delay := target - time.monotonic()) > SPIN_S:
        await asyncio.sleep(delay - SPIN_S)
    while time.monotonic() < target:
        await asyncio.sleep(0)
    rec.sent_s = time.monotonic() - t0
    try:
        async with session.post(url, data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    if rec.output_tokens < rec.max_tokens:
                        rec.error = (f"stream ended after {rec.output_tokens} of "
                                     f"{rec.max_tokens} tokens")
                    break
                if line.startswith(b'data: {"error"'):
                    rec.error = "stream error: " + line[6:206].decode(errors="replace")
                    return
                m = _USAGE_RE.search(line)
                if m and (n := int(m.group(1))) > rec.output_tokens:
                    rec.chunk_s.append(time.monotonic() - t0)
                    rec.output_tokens = n
    except Exception as exc:  # noqa: BLE001 - any client/server failure is this request's error
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


async def _client(base_url: str, model: str, requests: list[Request], t0: float,
                  deadline: float) -> list[Record]:
    import aiohttp

    url = base_url + "/v1/completions"
    bodies = [_body(model, r) for r in requests]  # serialised before the window opens
    recs = [Record(r.index, len(r.prompt), r.at_s, r.max_tokens) for r in requests]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        tasks = [asyncio.ensure_future(_one(session, url, b, t0, rec))
                 for b, rec in zip(bodies, recs)]
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.monotonic()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for rec in recs:
        if rec.error is not None:
            continue
        if math.isnan(rec.sent_s):
            rec.error = "not sent before the window's deadline"
        elif rec.output_tokens < rec.max_tokens:
            rec.error = "unfinished at the window's deadline"
    return recs


def client_process(base_url: str, model: str, requests: list[Request], t0: float,
                   deadline: float) -> list[Record]:
    """One client process' share of a window (runs in a pool worker). The cyclic GC is off
    during the window: a collection over the prompts' token ids pauses the loop for ms."""
    gc.disable()
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(_client(base_url, model, requests, t0, deadline))
        return uvloop.run(_client(base_url, model, requests, t0, deadline))
    finally:
        gc.enable()


def run_window(pool: ProcessPoolExecutor, clients: int, base_url: str, model: str,
               requests: list[Request], drain_timeout_s: float) -> tuple[list[Record], float]:
    """Offer `requests` through `clients` processes (request i goes to client i % clients).
    Returns the records by index and the window's wall seconds (start to last completion or
    deadline)."""
    t0 = time.monotonic() + START_LEAD_S
    deadline = t0 + max(r.at_s for r in requests) + drain_timeout_s
    shares = [requests[c::clients] for c in range(clients)]
    futures = [pool.submit(client_process, base_url, model, s, t0, deadline)
               for s in shares if s]
    recs = sorted((r for f in futures for r in f.result()), key=lambda r: r.index)
    return recs, time.monotonic() - t0


def _dist(values: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    """p50 / p90 / p99 / mean of `values` (seconds) in milliseconds; None without values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    out = {f"p{q}": round(percentile(values, q) * scale, 3) for q in (50, 90, 99)}
    out["mean"] = round(sum(values) / len(values) * scale, 3)
    return out


def summarize(records: Sequence[Record], rate: float) -> dict[str, Any]:
    """The statistics of one window. Failed requests count in `failed` and `errors` only."""
    ok = [r for r in records if r.error is None]
    per_request = {  # seconds by request index
        "ttft_ms": {r.index: r.chunk_s[0] - r.sent_s for r in ok},
        "tpot_ms": {r.index: (r.chunk_s[-1] - r.chunk_s[0]) / (r.output_tokens - 1)
                    for r in ok if r.output_tokens > 1},
        "e2e_ms": {r.index: r.chunk_s[-1] - r.sent_s for r in ok},
    }
    itl = [b - a for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    lag = [r.sent_s - r.scheduled_s for r in records if not math.isnan(r.sent_s)]
    span = max((r.chunk_s[-1] for r in ok), default=0.0)
    window = max((r.scheduled_s for r in records), default=0.0)
    offered = sum(r.max_tokens for r in records) / window if window > 0 else None
    tokens = sum(r.output_tokens for r in ok)
    merged = sum(r.output_tokens - len(r.chunk_s) for r in ok)
    errors = Counter(r.error for r in records if r.error is not None)
    send_lag = _dist(lag)
    send_lag["max"] = round(max(lag) * 1e3, 3) if lag else None
    indices = range(max((r.index for r in records), default=-1) + 1)
    return {
        "rate": rate,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(errors.most_common(5)),
        "arrival_window_s": round(window, 3),
        "span_s": round(span, 3),
        "prompt_tokens_mean": round(sum(r.prompt_len for r in ok) / len(ok), 1) if ok else None,
        "output_tokens": tokens,
        "ttft_ms": _dist(list(per_request["ttft_ms"].values())),
        "tpot_ms": _dist(list(per_request["tpot_ms"].values())),
        "itl_ms": _dist(itl),
        "e2e_ms": _dist(list(per_request["e2e_ms"].values())),
        "send_lag_ms": send_lag,
        "client_lagging": bool(lag) and send_lag["p99"] > LAG_P99_LIMIT_MS,
        "tokens_in_merged_chunks": merged,  # tokens that shared a chunk: ITL undercounts them
        "output_tokens_per_s": round(tokens / span, 1) if span > 0 else None,
        # what the arrivals asked for: all requested tokens over the arrival window
        "offered_output_tokens_per_s": round(offered, 1) if offered else None,
        "requests_per_s": round(len(ok) / span, 3) if span > 0 else None,
        # every request's value in ms by index, None where it has none: every mode is offered
        # the same requests, so the ratios' intervals resample them in pairs (serve_report)
        "samples": {f: [None if (v := values.get(i)) is None else round(v * 1e3, 3)
                        for i in indices]
                    for f, values in per_request.items()},
    }

