"""What the machine is, read without torch, vLLM or a CUDA init where it can be: whether a GPU is
usable (`gpu_problem`; `torch_cuda_problem` for the kernel benchmarks), its memory from
nvidia-smi (`gpu_memory_bytes`), and the environment a result records (`environment`: versions,
GPU and driver, git commit, `source_digest`, options).
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import hashlib
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.harness.protocol import WorkerResult
from benchmarks.harness.shapes import REPO_ROOT


def torch_cuda_problem(script: str) -> str | None:
    """Why the kernel benchmark `script` cannot run here (torch missing, no CUDA device), or
    None."""
    try:
        import torch
    except ImportError as exc:
        return f"{script} needs torch: {exc}"
    if not torch.cuda.is_available():
        return (f"{script} is a GPU benchmark: no CUDA device is visible "
                "(torch.cuda.is_available() is False). Run it on the H200.")
    return None


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output for `args` (no CUDA init), or None where it is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def gpu_problem() -> str | None:
    """Why no NVIDIA GPU is usable here, or None. Cheap: no torch, no vLLM, no CUDA init."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/proc/driver/nvidia/version"):
        return None
    if "GPU" in (nvidia_smi("-L") or ""):
        return None
    return "no NVIDIA GPU found (no /dev/nvidia*, no /proc/driver/nvidia, no working nvidia-smi)"


def gpu_memory_bytes() -> int | None:
    """Total memory of the first visible GPU from nvidia-smi (no CUDA init), or None."""
    out = nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader,nounits")
    try:
        return int(out.split()[0]) * 2**20 if out else None
    except (ValueError, IndexError):
        return None


def environment(
    args: argparse.Namespace,
    results: list[WorkerResult],
    layers: dict[str, int],
    bandwidths: list[float],
) -> dict[str, Any]:
    versions = next((r.versions for r in results if r.versions), {})

    def version(pkg: str) -> str:
        if pkg in versions:
            return versions[pkg]
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    gpu, driver = versions.get("gpu", "unknown"), "unknown"
    out = nvidia_smi("--query-gpu=name,driver_version", "--format=csv,noheader")
    if out and out.strip():
        try:
            gpu, driver = (s.strip() for s in out.splitlines()[0].split(",", 1))
        except ValueError:
            pass
    return {
        "gpu_name": gpu,
        "driver": driver,
        "cuda": versions.get("cuda", "unknown"),
        "torch": version("torch"),
        "vllm": version("vllm"),
        "triton": version("triton"),
        "python": versions.get("python", platform.python_version()),
        "git_commit": _git_commit(),
        "source_digest": source_digest(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "layers": layers,
        "hbm_bandwidth_gbps": round(statistics.median(bandwidths), 1) if bandwidths else None,
        "hbm_bandwidth_samples_gbps": [round(b, 1) for b in bandwidths],
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def _git_commit() -> str:
    """$BENCH_GIT_COMMIT when set (pass it in the device command: the device copy of the repo
    has no .git of its own, and one it finds can be stale), else HEAD (+dirty), else
    "unknown"."""
    given = os.environ.get("BENCH_GIT_COMMIT", "").strip()
    if given:
        return f"{given} (from BENCH_GIT_COMMIT)"
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0:
            dirty = subprocess.run(
                ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown (no git checkout here)"


def source_digest() -> str:
    """sha256 (16 hex) of the Python sources of vllm_moe_graphs/ and benchmarks/: names the code
    that ran even where there is no git."""
    digest = hashlib.sha256()
    for path in sorted(REPO_ROOT.glob("vllm_moe_graphs/**/*.py")) + sorted(
        REPO_ROOT.glob("benchmarks/*.py")
    ):
        digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]
