"""A mode worker as a child process: `python -m benchmarks.harness.mode_worker SPEC.json` in its
own process group, its output pumped into a log (`[bench]` lines echoed), its control lines
(READY / DONE, `--interleave`) queued, and its end: wait, kill the group at the limit, read the
result file (`WorkerProcess`, `run_worker`).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from benchmarks.harness.protocol import (
    DONE,
    READY,
    WorkerResult,
    WorkerSpec,
    result_from_json,
    spec_to_json,
    write_json_atomic,
)
from benchmarks.harness.shapes import REPO_ROOT

KILL_GRACE_S = 5.0


def _pump(stream: TextIO, log: TextIO, control: queue.Queue[str] | None = None) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if line.startswith("[bench]"):
            print("  " + line.rstrip(), flush=True)
        elif control is not None and line.startswith((READY, DONE)):
            control.put(line.rstrip())
    if control is not None:
        control.put(EXITED)


EXITED = "[exited]"  # put by the pump when the worker's stdout ends


def stop_group(proc: subprocess.Popen[str]) -> None:
    """End the worker's process group (the worker and whatever it started), if anything is left.

    The group id is the worker's pid (start_new_session=True), so only processes it started."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        if sig is signal.SIGTERM:
            time.sleep(0.5)  # give the rest of the group its moment before SIGKILL


class WorkerProcess:
    """One started mode worker: its process, log, output pump and (interleaved) control lines."""

    module = "benchmarks.harness.mode_worker"  # what `python -m` runs (tests put a stand-in here)

    def __init__(self, spec: WorkerSpec, work_dir: Path, interactive: bool = False,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.spec = spec
        stem = f"{spec.model}-{spec.mode}" + (f"-r{spec.round}" if spec.round else "")
        spec_path, self.log_path = work_dir / f"spec-{stem}.json", work_dir / f"log-{stem}.txt"
        write_json_atomic(spec_path, spec_to_json(spec))
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                            if p)
        self.t0 = time.monotonic()
        self.control: queue.Queue[str] | None = queue.Queue() if interactive else None
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, str(spec_path), *extra_args],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: compile helpers die with it
        )
        assert self.proc.stdout is not None, "Popen with stdout=PIPE has a stdout"
        self.pump = threading.Thread(target=_pump, args=(self.proc.stdout, self.log, self.control),
                                     daemon=True)
        self.pump.start()
        self.killed = False
        self.error: str | None = None  # a run-level error found while it ran

    def wait_line(self, timeout_s: float) -> str | None:
        """The next control line (READY / DONE ... / EXITED); None after `timeout_s`."""
        assert self.control is not None, "not an interleaved worker"
        try:
            return self.control.get(timeout=max(0.1, timeout_s))
        except queue.Empty:
            return None

    def send(self, line: str) -> bool:
        try:
            assert self.proc.stdin is not None, "not an interleaved worker"
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def finish(self, timeout_s: float) -> tuple[WorkerResult, str | None]:
        """Wait up to `timeout_s` for the worker to exit (then kill it); its result and a
        run-level error."""
        try:
            self.proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            self.killed = True
        finally:  # also on KeyboardInterrupt: never leave a worker behind
            stop_group(self.proc)
        self.pump.join(timeout=5)
        self.log.close()
        elapsed = time.monotonic() - self.t0
        spec = self.spec
        try:
            result = result_from_json(json.loads(Path(spec.result_path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            result = WorkerResult(
                model=spec.model, mode=spec.mode, status="failed", error=f"no result file ({exc})"
            )
        error = self.error
        if error is None and self.killed:
            error = (
                f"killed at its time limit after {elapsed:.0f} s (worker status was "
                f"{result.status!r}); points measured before are kept"
            )
        elif error is None and result.status in ("starting", "running"):
            error = (f"worker exited with code {self.proc.returncode} before finishing (status "
                     f"{result.status!r})")
        elif error is None and result.status == "failed":
            error = result.error or "failed"
        if error:
            tail = self.log_path.read_text(errors="replace").splitlines()[-25:]
            print(f"  worker log tail ({self.log_path}):\n    " + "\n    ".join(tail), flush=True)
        return result, error


def run_worker(spec: WorkerSpec, work_dir: Path, limit_s: float,
               extra_args: tuple[str, ...] = ()) -> tuple[WorkerResult, str | None]:
    """Run one worker to completion or `limit_s`; returns its result and a run-level error.
    `extra_args` go to the worker's command line (e.g. `--allow-cpu`)."""
    return WorkerProcess(spec, work_dir, extra_args=extra_args).finish(limit_s)
