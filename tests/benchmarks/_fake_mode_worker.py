"""A stand-in for `benchmarks.harness.mode_worker` (tests only): no engine, no GPU.

Speaks the worker's stdin/stdout protocol and writes a WorkerResult like the real one. Each
recorded repeat gets steps of `FAKE_STEP_MS_<MODE>` ms (default 1.0), plus `FAKE_SAMPLED_MS`
(default 0) under a sampling preset other than greedy; the mode named in
`FAKE_DIE_MODE` exits without answering at its first recorded repeat; every command takes
`FAKE_SLEEP_S` seconds (default 0). Every command it gets
is appended, with the time, to `<result_path>.commands`.
"""

from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.harness.protocol import (
    DONE,
    READY,
    WorkerResult,
    WorkerSpec,
    result_to_json,
    spec_from_json,
    write_json_atomic,
)


def one_start(spec: WorkerSpec) -> None:
    """A non-interactive run (`benchmarks.startup`): start-up `FAKE_COLD_S_<MODE>` (default 2.0)
    when `$VLLM_CACHE_ROOT/fake-warm` is absent (then written), else `FAKE_WARM_S_<MODE>`
    (default 1.0); one point, wall 0.5 s."""
    marker = os.path.join(os.environ["VLLM_CACHE_ROOT"], "fake-warm")
    cold = not os.path.exists(marker)
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    open(marker, "w").close()
    result = WorkerResult(model=spec.model, mode=spec.mode, status="ok", import_s=0.2,
                          startup_s=float(os.environ.get(
                              f"FAKE_{'COLD' if cold else 'WARM'}_S_{spec.mode.upper()}",
                              "2.0" if cold else "1.0")),
                          resolved={"cache_root": os.environ["VLLM_CACHE_ROOT"]})
    point = result.point(spec.batches[0], spec.contexts[0])
    point.repeat_p50_ms, point.prefill_s, point.point_s = [1.0], [0.1], [0.5]
    point.repeats_done = 1
    write_json_atomic(spec.result_path, result_to_json(result))
    if cold and os.environ.get("FAKE_COLD_JIT") == spec.mode:
        print("WARNING [jit_monitor.py:135] Triton kernel JIT compilation during inference: "
              "_fake_kernel. This causes a latency spike.", flush=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = spec_from_json(json.load(f))
    if not spec.interleaved:
        one_start(spec)
        return
    result = WorkerResult(model=spec.model, mode=spec.mode, status="running", startup_s=0.1)
    write_json_atomic(spec.result_path, result_to_json(result))
    step = float(os.environ.get(f"FAKE_STEP_MS_{spec.mode.upper()}", "1.0"))
    log = open(spec.result_path + ".commands", "a")  # noqa: SIM115 - until exit
    print(READY, flush=True)
    for line in sys.stdin:
        log.write(f"{time.monotonic():.6f} {line}")
        log.flush()
        words = line.split()
        if words == ["quit"]:
            break
        batch, context, rep = (int(w) for w in words[1:4])
        sampling = words[4] if len(words) == 5 else "greedy"
        time.sleep(float(os.environ.get("FAKE_SLEEP_S", "0")))
        if rep >= 0 and os.environ.get("FAKE_DIE_MODE") == spec.mode:
            os._exit(3)
        if rep >= 0:
            point = result.point(batch, context, sampling)
            ms = step + (float(os.environ.get("FAKE_SAMPLED_MS", "0"))
                         if sampling != "greedy" else 0.0)
            point.step_ms += [ms] * 4
            point.repeat_p50_ms.append(ms)
            point.prefill_s.append(0.0)
            point.repeats_done += 1
            write_json_atomic(spec.result_path, result_to_json(result))
        print(f"[bench] {spec.mode} rep {rep} b={batch} c={context} {sampling}", flush=True)
        print(f"{DONE} ok", flush=True)
    result.status = "ok"
    write_json_atomic(spec.result_path, result_to_json(result))


if __name__ == "__main__":
    main()
