"""How the benchmarks' requests sample: the presets of `benchmarks.decode --sampling` and the
Qwen3 chat numbers that the serving benchmark's `chat_sampled` workload sends too (one place).

A preset gives a request's `vllm.SamplingParams` sampling arguments; the caller adds the length
(`max_tokens`, `ignore_eos`) and the output form. No vLLM here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

GREEDY = "greedy"

# Qwen3's model card advice for chat without thinking (a real checkpoint's
# generation_config.json sets 0.6 / 0.95 / 20, which `vllm serve` applies to requests that set
# none): most clients sample. vLLM's sampler then sorts every row's logits for top-p/top-k,
# eagerly, after the forward (and after the plugin's graph replay).
QWEN3_CHAT_SAMPLING: tuple[tuple[str, float], ...] = (
    ("temperature", 0.7), ("top_p", 0.8), ("top_k", 20))


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingPreset:
    name: str
    description: str
    params: tuple[tuple[str, float], ...] = ()  # over greedy (temperature 0), (name, value)
    # NOTE: a seeded request takes another sampler path than an unseeded one: vLLM's V1 runner
    # (the plugin's) then skips FlashInfer and draws its noise row by row (a launch per seeded
    # row), the V2 runner (stock's default) only skips FlashInfer. Serving clients send none.
    seeded: bool = False  # request i of a point gets seed `--seed` + i: the same tokens each run

    def kwargs(self, seed: int, index: int) -> dict[str, float]:
        """Request `index`'s sampling arguments of `vllm.SamplingParams` under this preset."""
        if not self.params:
            return {"temperature": 0.0}
        return {**dict(self.params), **({"seed": seed + index} if self.seeded else {})}

    def record(self) -> dict[str, float | bool]:
        """What a result file and a plan say of the preset: its arguments, seeded or not."""
        return {**(dict(self.params) or {"temperature": 0.0}), "seeded": self.seeded}


PRESETS: dict[str, SamplingPreset] = {
    p.name: p
    for p in (
        SamplingPreset(GREEDY, "temperature 0: the argmax token"),
        SamplingPreset("qwen3", "temperature 0.7, top-p 0.8, top-k 20 (Qwen3's chat advice); "
                       "request i seeded --seed + i", QWEN3_CHAT_SAMPLING, seeded=True),
        SamplingPreset("qwen3_unseeded", "qwen3 unseeded, as serving clients (and chat_sampled) "
                       "send it", QWEN3_CHAT_SAMPLING),
    )
}


def parse_presets(names: Sequence[str]) -> list[str]:
    """`names` checked and without repeats, in their order; ValueError naming the unknown ones
    and the valid ones."""
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        given = ", ".join(map(repr, unknown)) or "(none given)"
        raise ValueError(f"unknown sampling preset(s) {given}; valid: {', '.join(PRESETS)}")
    return list(dict.fromkeys(names))


def key_suffix(preset: str) -> str:
    """What a ratio key or label gets for `preset`: nothing for greedy (keys as before presets
    existed), else `/<preset>`."""
    return "" if preset == GREEDY else f"/{preset}"
