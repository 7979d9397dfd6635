"""Host-side check of a batch's sampling parameters: can `ops.sampling.sample` serve it?

Runs on the CPU copies of the parameters (vLLM's `InputBatch.*_cpu_tensor[:n]`), outside any
captured region, before the step is planned; the answer is data, a frozen `Servability` with a
`SamplingRefusal` from a fixed set, the first refused row and a sentence for the log. Only the
parameters the op reads are judged here: a batch with penalties, logit bias, allowed or bad
words or min-tokens (unless the caller writes their masks into the logits first), custom
logits processors, a logprobs mode other than `raw_logprobs` or top-n logprobs is the caller's
to refuse before asking.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from vllm_moe_graphs.ops.sampling import NUM_CANDIDATES, SAMPLING_EPS

# The largest top_k served: half the candidates, so that a tie at the k-th largest logit spills
# past them (an inexact row) only with more than NUM_CANDIDATES - 64 = 65 tokens tied there.
# With 128 (the op's limit) a realistic bf16 row of Qwen3's vocabulary spilled in 26 of 30
# seeds (tests/ops/sampling_ref.make_logits), at 100 and below in none. Qwen3's advised 20 and
# the usual 40 / 50 are served.
MAX_SERVED_TOP_K = 64
assert MAX_SERVED_TOP_K < NUM_CANDIDATES


class SamplingRefusal(str, enum.Enum):
    """Why a batch's sampling cannot run inside the graph. The value is a metrics label.

    The first five are judged by `servable` on the op's parameters; the rest by the caller on
    what else the batch asks of vLLM's sampler (integration/runner/graph_sampling.py)."""

    SERVABLE = "servable"
    SEEDED = "seeded"  # a per-request generator: vLLM draws its noise row by row
    TOP_K_DISABLED = "top_k_disabled"  # a random row sampling beyond the candidates
    TOP_K_TOO_LARGE = "top_k_too_large"  # above MAX_SERVED_TOP_K
    INVALID_PARAMETER = "invalid_parameter"  # outside what SamplingParams validates
    ALL_GREEDY = "all_greedy"  # vLLM's argmax: a few launches, nothing to gain
    PENALTIES = "penalties"  # repetition / presence / frequency: read the output history
    LOGIT_BIAS = "logit_bias"
    LOGPROBS = "logprobs"  # top-n or specific-token logprobs, or a request's own logprob
    LOGITS_PROCESSORS = "logits_processors"  # a custom processor or a thinking budget
    SPEC_DECODE = "spec_decode"  # vLLM's rejection sampler
    BATCH_TOO_LARGE = "batch_too_large"  # more rows than the sampler's largest bucket
    LOGITS_SHAPE = "logits_shape"  # logits not [requests, vocabulary] in the model's dtype
    KILL_SWITCH = "kill_switch"  # the runtime kill switch is on: vLLM samples every step
    SAMPLER_FAILED = "sampler_failed"  # a sampler graph failed (logged): vLLM samples on


@dataclass(frozen=True, slots=True)
class Servability:
    reason: SamplingRefusal
    row: int | None = None  # the first refused row
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is SamplingRefusal.SERVABLE


def _floats(values: torch.Tensor | Sequence[float]) -> list[float]:
    return torch.as_tensor(values, device="cpu").tolist()


def servable(
    temperature: torch.Tensor | Sequence[float],
    top_k: torch.Tensor | Sequence[int],
    top_p: torch.Tensor | Sequence[float],
    min_p: torch.Tensor | Sequence[float],
    *,
    vocab_size: int,
    seeded_rows: Collection[int] = (),
) -> Servability:
    """Whether `sample` serves these n rows (CPU tensors or sequences [n] in vLLM's encoding:
    temperature 0 for greedy, top_k = vocab_size or <= 0 when disabled, top_p 1.0 and min_p
    0.0 when disabled; `seeded_rows`: the keys of `SamplingMetadata.generators`).

    Greedy rows are always served. A random row is served when its top_k is enabled and at
    most MAX_SERVED_TOP_K (top-p and min-p then act on the top-k candidates only); top-p or
    min-p alone, or plain sampling over the vocabulary, could keep more tokens than the op
    looks at.
    Raises ValueError when the lengths differ."""
    temps, ks, ps, mins = (_floats(t) for t in (temperature, top_k, top_p, min_p))
    if not len(temps) == len(ks) == len(ps) == len(mins):
        raise ValueError(
            "temperature, top_k, top_p, min_p must have one length, got "
            f"{[len(temps), len(ks), len(ps), len(mins)]}"
        )
    for row in sorted(seeded_rows):
        if not 0 <= row < len(temps):
            raise ValueError(f"seeded row {row} outside the batch of {len(temps)} rows")
        if temps[row] >= SAMPLING_EPS:
            return Servability(SamplingRefusal.SEEDED, row,
                               f"row {row} has its own seed: vLLM's sampler draws its noise")
    for row, (t, k, p, m) in enumerate(zip(temps, ks, ps, mins, strict=True)):
        if not (math.isfinite(t) and t >= 0):
            return Servability(SamplingRefusal.INVALID_PARAMETER, row,
                               f"row {row}: temperature {t} is not a finite number >= 0")
        if t < SAMPLING_EPS:
            continue  # greedy: argmax of the logits, nothing else is read
        if not 0 < p <= 1 or not 0 <= m <= 1:
            return Servability(SamplingRefusal.INVALID_PARAMETER, row,
                               f"row {row}: top_p {p} must be in (0, 1], min_p {m} in [0, 1]")
        if k <= 0 or k >= vocab_size:
            return Servability(SamplingRefusal.TOP_K_DISABLED, row,
                               f"row {row} samples without top-k (top_k {k}, vocabulary "
                               f"{vocab_size}): top_k 1..{MAX_SERVED_TOP_K} is served")
        if k > MAX_SERVED_TOP_K:
            return Servability(SamplingRefusal.TOP_K_TOO_LARGE, row,
                               f"row {row}: top_k {k} > {MAX_SERVED_TOP_K}, the most served")
    return Servability(SamplingRefusal.SERVABLE)
