"""What the decode benchmark harness tests share: `_cli` runs `python -m benchmarks.decode` in a
subprocess, `_shape` reads a shipped model shape, `_Engine` stands in for vLLM's `LLMEngine`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.harness.shapes import (
    ModelShape,
    read_config,
    shipped_config_dir,
)


REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.decode", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def _shape(name: str) -> ModelShape:
    return ModelShape.from_config(read_config(shipped_config_dir(name)))


class _Engine:
    """Stand-in for LLMEngine's add_request/step/has_unfinished_requests/abort_request with
    chunked prefill (decodes first, then prefill chunks within the token budget). With `lag`, a
    step returns the previous batch's outputs, as async scheduling (batch queue of 2) does."""

    def __init__(self, budget: int, lag: bool) -> None:
        self.budget, self.lag, self.reqs, self.held = budget, lag, {}, []
        self.params: dict[str, SimpleNamespace] = {}  # by request id, as added
        self.prefill_sleep_s = 0.05

    def add_request(self, rid: str, prompt: dict, params: SimpleNamespace) -> str:
        self.params[rid] = params
        self.reqs[rid] = {
            "left": len(prompt["prompt_token_ids"]),
            "out": 0,
            "max": params.max_tokens,
        }
        return rid + "-x"

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs or self.held)

    def abort_request(self, ids: list[str]) -> None:
        for rid in ids:
            self.reqs.pop(rid, None)

    def step(self) -> list[SimpleNamespace]:
        if not self.lag:
            return self._schedule()
        out, self.held = self.held, (self._schedule() if self.reqs else [])
        return out

    def _schedule(self) -> list[SimpleNamespace]:
        budget, new = self.budget, {}
        for rid, r in self.reqs.items():
            if r["left"] == 0:
                new[rid], budget = 1, budget - 1
        for rid, r in self.reqs.items():
            if r["left"] and budget > 0:
                take = min(r["left"], budget)
                r["left"], budget = r["left"] - take, budget - take
                if r["left"] == 0:
                    new[rid] = 1
                time.sleep(self.prefill_sleep_s)  # prefill is slow: it must never be timed
        outs = []
        for rid, n in new.items():
            self.reqs[rid]["out"] += n
            done = self.reqs[rid]["out"] >= self.reqs[rid]["max"]
            outs.append(
                SimpleNamespace(
                    request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=[0] * n)]
                )
            )
            if done:
                del self.reqs[rid]
        return outs
