"""What every kernel benchmark's command line shares: its parser with `--out` (`kernel_parser`),
the CUDA-graph replay options (`add_replay_options`), the comma-list option types (`int_list`,
`split_list`), its `main` (`kernel_main`: exit 2 with the reason on stderr where torch, a CUDA
device or what the benchmark `needs` is missing, else its run) and the JSON written to `--out`
with the options that made it (`options_record`, `write_result`).

A kernel module run as a script (`python benchmarks/kernels/attn.py`) puts this checkout on
sys.path before it imports this (its first lines)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import torch_cuda_problem

EXIT_NO_CUDA = 2


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def split_list(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    for x in items:
        if x != "auto" and not x.isdigit():
            raise argparse.ArgumentTypeError(f"split values are 'auto' or integers, got {x!r}")
    return items


def kernel_parser(description: str | None) -> argparse.ArgumentParser:
    """A kernel benchmark's parser: `description` (its module docstring) as written, `--out`."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write the results to")
    return p


def add_replay_options(p: argparse.ArgumentParser, launches: int, launches_help: str,
                       replays: int, warmup: int) -> None:
    """`--graph-launches` (default `launches`; `launches_help` says what it means here),
    `--replays` and `--warmup-replays` of `time_graph`."""
    p.add_argument("--graph-launches", type=int, default=launches, help=launches_help)
    p.add_argument("--replays", type=int, default=replays,
                   help=f"timed graph replays per measurement (default: {replays})")
    p.add_argument("--warmup-replays", type=int, default=warmup,
                   help=f"untimed graph replays before timing (default: {warmup})")


def options_record(args: argparse.Namespace, drop: Collection[str] = ()) -> dict[str, Any]:
    """`args` as JSON values (paths as strings), without the options named in `drop`."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k not in drop}


def write_result(result: dict[str, Any], out: Path) -> None:
    """`result` as indented JSON at `out` (its folder made), and a line saying so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"# wrote {out}")


def kernel_main(script: str, argv: list[str] | None,
                parse_args: Callable[[list[str] | None], argparse.Namespace],
                run: Callable[[argparse.Namespace], int],
                needs: Callable[[], str | None] | None = None) -> int:
    """The main of kernel benchmark `script` (its `python -m` name): parse `argv`; without torch
    or a CUDA device, or where `needs()` gives a reason, print it to stderr and return 2; else
    `run(args)`'s exit status."""
    args = parse_args(argv)
    problem = torch_cuda_problem(script)
    if problem is None and needs is not None:
        problem = needs()
    if problem is not None:
        print(problem, file=sys.stderr)
        return EXIT_NO_CUDA
    return run(args)
