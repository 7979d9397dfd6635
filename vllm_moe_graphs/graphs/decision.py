"""`Decision`: what the graph runner does with one step (replay, capture, or eager and why), and
the rows its forward runs on. Host values only; no vLLM import."""

from __future__ import annotations

import dataclasses
import enum

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.graphs.buckets import GraphKey


class Action(str, enum.Enum):
    REPLAY = "replay"
    CAPTURE = "capture"  # capture now, then replay once for this step's output
    EAGER = "eager"


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What one step does (decode, or with prefill tokens: `num_reqs` counts the forward's
    rows). `reason` is ELIGIBLE for REPLAY, CAPTURE and warm-up steps (EAGER at the padded
    size, not a fallback); otherwise why the step runs eager."""

    action: Action
    key: GraphKey | None
    reason: Reason
    num_reqs: int

    @property
    def warming_up(self) -> bool:
        return self.action is Action.EAGER and self.reason is Reason.ELIGIBLE

    @property
    def padded(self) -> bool:
        """Whether the forward runs at the key's padded size: on graph paths and warm-up, and
        in the fallbacks of a key that could be graphed (`PADDED_FALLBACKS`), so that such a
        step computes exactly what its graph would (cuBLAS picks its GEMM kernel by the row
        count: padded and unpadded rows can differ in the last bit)."""
        return self.key is not None and (self.action is not Action.EAGER or self.warming_up
                                         or self.reason in PADDED_FALLBACKS)

    @property
    def batch_size(self) -> int:
        """Rows the forward runs on: the key's bucket when `padded`, else the real rows."""
        return self.key.batch_bucket if self.padded else self.num_reqs


# Eager fallbacks that keep their key's padded shape: the kill switch stops replay, a
# quarantined or over-budget key stops capture, none of them changes what the step computes.
# Storage and capability fallbacks run vLLM's own unpadded step (nothing is vouched for).
PADDED_FALLBACKS = frozenset({Reason.KILL_SWITCH, Reason.CAPTURE_FAILED, Reason.MEMORY_BUDGET})
