"""The variants of vLLM's top-k/top-p sampling kernel that traffic can reach, compiled into
Triton's cache by a low-priority subprocess from the end of the start-up warm-up on.

vLLM 0.26 masks the logits of a batch of 8 or more sampled rows with top-k and/or top-p through
its Triton kernel `_topk_topp_kernel`. A variant is compiled on first launch, on the engine's
only thread: 6-8 s with no step running, every request waiting. Start-up compiles one variant
(top-k and top-p on, the profile run's row count: `sampler_warm_up.py`); traffic reaches six:
top-k and top-p, top-p only, top-k only (constexpr flags; with one off, its pointer argument is
the float32 logits), each for a row count divisible by 16 and one that is not (Triton
specialises integer arguments on divisibility by 16). Qwen3's generation config turns on both
(top-k 20, top-p 0.95), so on `vllm serve` of a Qwen3 checkpoint the first batch of, say, 9
requests compiles a variant in the middle of serving.

`start_serving_variants` (from the runner's `capture_model`, once) compiles each variant the
engine can reach in a subprocess (`python -m vllm_moe_graphs.integration.startup.sampling_variants`,
niced, without CUDA: `CUDA_VISIBLE_DEVICES` empty and a Triton driver that only names the GPU's
target, so no CUDA context and no GPU memory) through Triton's `warmup` of vLLM's own kernel,
which writes each into Triton's on-disk cache; the subprocess shares the engine's environment
and so its cache directory and key. A launch that needs one then loads it from the cache (no
compile) instead of compiling it. A thread of the engine only waits for the subprocess and logs
what it did; a Triton compile in a thread of the engine would hold the GIL for up to 0.2 s at a
time (measured on CPU), the subprocess holds none of it. It ends with the engine process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm_moe_graphs.integration.startup.sampler_warm_up import (
    TRITON_MIN_ROWS,
    kernel_variant,
    launched_kernel,
    sampled_rows,
    sampling_kernel,
)

logger = logging.getLogger("vllm.moe_graphs")

# Triton's specialisations of the row count from TRITON_MIN_ROWS up: not divisible by 16, and
# divisible by 16 (a representative of each)
ROW_CLASSES = (TRITON_MIN_ROWS, 16)
# (top-k, top-p): both (Qwen3's generation config), top-p only, top-k only
FLAGS = ((True, True), (False, True), (True, False))


@dataclass(frozen=True)
class Variant:
    rows: int
    top_k: bool
    top_p: bool


def serving_variants(max_rows: int) -> list[Variant]:
    """The variants a batch of at most `max_rows` sampled rows (min(max_num_seqs,
    max_num_batched_tokens)) can launch, most common first."""
    return [Variant(rows, k, p) for k, p in FLAGS for rows in ROW_CLASSES if rows <= max_rows]


class ServingVariantsCompile:
    """The subprocess and the engine thread that waits for it (see the module docstring)."""

    def __init__(self, argv: list[str], variants: list[Variant]) -> None:
        self.variants = variants
        self.seconds: float | None = None
        self.compiled: list[dict[str, Any]] = []  # the subprocess's report, one per variant
        self.error: str | None = None
        self._start = time.perf_counter()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._wait, name="moe_graphs-sampling-variants",
                                        daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        out, err = self._proc.communicate()
        self.seconds = time.perf_counter() - self._start
        self.compiled = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if self._proc.returncode != 0:
            tail = err.strip().splitlines()[-1:] or ["no output"]
            self.error = f"exit {self._proc.returncode}: {tail[0]}"
            logger.warning("moe_graphs: the subprocess compiling vLLM's top-k/top-p sampling "
                           "kernel for serving failed after %d of %d variant(s) (%s); a batch "
                           "that needs another compiles it on the engine's thread, as in stock "
                           "vLLM", len(self.compiled), len(self.variants), self.error)
            return
        slowest = max((c["seconds"] for c in self.compiled), default=0.0)
        logger.info("moe_graphs: %d variant(s) of vLLM's top-k/top-p sampling kernel for "
                    "serving (top-k and/or top-p, batches of %s rows) in Triton's cache, "
                    "compiled by a subprocess in %.1f s after start-up (the slowest %.1f s): a "
                    "batch that needs one loads it instead of compiling it on the engine's "
                    "thread", len(self.compiled),
                    " and ".join(sorted({str(v.rows) for v in self.variants}, key=int)),
                    self.seconds, slowest)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the subprocess and its log line; True when both are done."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def start_serving_variants(rows: int, vocab_size: int,
                           device: Any) -> ServingVariantsCompile | None:
    """Start the subprocess for the variants of at most `rows` sampled rows of `vocab_size`
    logits on CUDA `device`; None where vLLM never launches the kernel (`launched_kernel`)
    or compiles nothing (Triton's interpreter)."""
    if launched_kernel(rows, device) is None:
        return None
    from triton import knobs
    from triton.runtime import driver

    if knobs.runtime.interpret:
        return None
    target = driver.active.get_current_target()  # the engine thread's current device
    variants = serving_variants(rows)
    target_fields = [target.backend, target.arch, target.warp_size]
    return launch(subprocess_argv(target_fields, vocab_size, variants), variants)


def launch(argv: list[str], variants: list[Variant]) -> ServingVariantsCompile | None:
    """`ServingVariantsCompile` of `argv`; None, with a warning, where no process can start."""
    try:
        return ServingVariantsCompile(argv, variants)
    except OSError as exc:  # e.g. out of memory: serving goes on
        logger.warning("moe_graphs: no subprocess to compile vLLM's top-k/top-p sampling kernel "
                       "for serving (%s: %s); a batch that needs a variant compiles it on the "
                       "engine's thread, as in stock vLLM", type(exc).__name__, exc)
        return None


def subprocess_argv(target: list[Any], vocab_size: int, variants: list[Variant]) -> list[str]:
    """The command line of the subprocess: this module, with the Triton target (backend, arch,
    warp size), the vocabulary and the variants as one JSON argument."""
    request = {"target": target, "vocab_size": vocab_size, "parent": os.getpid(),
               "variants": [[v.rows, v.top_k, v.top_p] for v in variants]}
    return [sys.executable, "-m", __name__, json.dumps(request)]


def start_for_runner(runner: Any) -> ServingVariantsCompile | None:
    """`start_serving_variants` for vLLM's V1 `GPUModelRunner` `runner` (`sampled_rows`)."""
    sampled = sampled_rows(runner)
    return None if sampled is None else start_serving_variants(*sampled, runner.device)


class _TargetOnlyDriver:
    """What Triton's `warmup` asks of its driver, without CUDA: a device index, a stream and
    the GPU's target. Compiling needs no more; loading and launching (never done here) would."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self._target


def compile_variants(request: dict[str, Any]) -> None:
    """The subprocess: compile each requested variant for the requested target into Triton's
    cache, one JSON line per variant on stdout."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(_TargetOnlyDriver(GPUTarget(*request["target"])))
    kernel = sampling_kernel()
    if kernel is None:
        raise RuntimeError("vLLM's _topk_topp_kernel is not a Triton JIT function here")
    for rows, top_k, top_p in request["variants"]:
        args, kwargs = kernel_variant(rows, request["vocab_size"], top_k, top_p)
        start = time.perf_counter()
        kernel.warmup(*args, grid=(1,), **kwargs)
        print(json.dumps({"rows": rows, "top_k": top_k, "top_p": top_p,
                          "seconds": round(time.perf_counter() - start, 3)}), flush=True)


def _die_with(parent: int) -> None:
    """On Linux, end this process when the engine process that started it ends (its engine
    core is a multiprocessing child, which runs no `atexit` handler)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # it ended before the line above
        os._exit(0)


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch and vLLM load: no CUDA context
    _request = json.loads(sys.argv[1])
    _die_with(_request["parent"])
    os.nice(10)
    compile_variants(_request)
