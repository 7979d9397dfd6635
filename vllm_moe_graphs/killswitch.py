"""The runtime kill switch (`MOE_GRAPHS_KILL_FILE`).

While the kill file exists, every decode batch runs eager; captured graphs are kept, and replay
resumes when the file is removed. `active()` is called once per batch: it touches the file system
at most once per `interval_s` (default 0.1 s), so a step costs a clock read, not a syscall.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


class KillSwitch:
    """File-backed switch with bounded staleness (`interval_s`)."""

    __slots__ = ("path", "interval_s", "_clock", "_next_check", "_active", "flips")

    def __init__(
        self,
        path: str | None,
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s={interval_s!r} must be >= 0")
        self.path = path
        self.interval_s = interval_s
        self._clock = clock
        self._next_check = float("-inf")
        self._active = False
        self.flips = 0  # number of on/off transitions seen, for metrics and tests

    @classmethod
    def from_env(cls) -> KillSwitch:
        from vllm_moe_graphs import envs

        return cls(envs.MOE_GRAPHS_KILL_FILE)

    def active(self) -> bool:
        """True while the kill file exists (seen at most `interval_s` ago)."""
        if self.path is None:
            return False
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self.interval_s
            active = os.path.exists(self.path)
            if active != self._active:
                self._active = active
                self.flips += 1
        return self._active
