"""Token sampling with vLLM 0.26's semantics, safe to capture in a CUDA graph.

Shapes: B = rows (a padded batch), V = vocabulary, C = candidates (NUM_CANDIDATES).
logits [B, V] (any float dtype); the parameters are device tensors [B] in vLLM's encoding
(`SamplingTensors`); token_ids [B] int64.

Semantics are those of vLLM 0.26's `Sampler` for a batch without penalties, logit bias,
allowed / bad words or other logits processors, in `raw_logprobs` mode: float32 logits; greedy
rows (temperature < 1e-5) take `argmax` of the logits (the first index among ties); random rows
divide by their temperature, then min-p (a token whose probability is below `min_p` times the
largest is dropped), top-k (every token whose logit is below the k-th largest is dropped: ties
with the k-th all stay), top-p (`apply_top_k_top_p_pytorch`: ascending sort, cumulative sum of
the top-k-filtered softmax, tokens whose sum is <= 1 - top_p dropped, the largest always kept),
then the exponential race (`random_sample`: argmax of probs / Exp(1) noise).

Design: `torch.topk` takes the C largest logits once; everything after runs on those C
candidates. That is exact whenever the tokens that survive top-k are all among them, i.e.
whenever top_k <= K_CAP and the k-th largest logit is not tied with the C-th (the extra
candidate is a sentinel that sees such ties): a token outside the candidates then has
probability 0 in vLLM too, and softmax over the candidates is vLLM's softmax over the
vocabulary. A row where the sentinel survives top-k and min-p is reported in `exact`; rows
with top-k disabled or above K_CAP are the caller's to refuse (`sampling_plan.servable`).
Candidates are ordered by logit, descending, ties by token id descending: the reverse of the
stable ascending sort vLLM's top-p runs on CUDA at vocabulary width, so a tie that straddles
the top-p cut keeps the same tokens.

Graph safety: fixed shapes for a given (B, V); no host sync, no data-dependent shape, no Python
branch on tensor values; every per-row parameter is read from a device tensor; the noise comes
from the default generator (a CUDA graph capture registers it; per-request seeded generators
are not supported: those rows go to vLLM's sampler). Temporaries are allocated inside the op
(inside a capture: from the graph's pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

K_CAP = 128  # the largest top_k served: Qwen3's advised 20 and the usual 40 / 50 / 64 / 100
NUM_CANDIDATES = K_CAP + 1  # one more: a sentinel that tells when the k-th value's ties spill
SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it means greedy


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, in vLLM's `InputBatch` encoding.

    temperature [B] float32: 0 (below SAMPLING_EPS) for a greedy row;
    top_k [B] int32 (or float32 holding integers, as one packed parameter buffer stores it):
        the vocabulary size when disabled (vLLM's encoding for 0 / -1);
    top_p [B] float32: 1.0 when disabled;
    min_p [B] float32: 0.0 when disabled.
    Padding rows should be greedy (temperature 0); their other values are never read as indices
    unclamped, so anything finite is safe.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, device: torch.device | str) -> SamplingTensors:
        """Static buffers for `rows` rows, every row greedy until filled."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            temperature=torch.zeros(rows, **f32),
            top_k=torch.ones(rows, dtype=torch.int32, device=device),
            top_p=torch.ones(rows, **f32),
            min_p=torch.zeros(rows, **f32),
        )

    @property
    def rows(self) -> int:
        return self.temperature.shape[0]

    def fill(
        self,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
    ) -> None:
        """Host side, outside any capture: copy the first n rows' parameters (CPU tensors [n],
        vLLM's `*_cpu_tensor[:n]`) into the leading slices; rows n.. become greedy padding.
        The copies are asynchronous from pinned memory; nothing waits on the device."""
        n = temperature.shape[0]
        if not top_k.shape[0] == top_p.shape[0] == min_p.shape[0] == n or n > self.rows:
            raise ValueError(
                f"expected four parameter tensors of one length <= {self.rows} rows, got "
                f"{[t.shape[0] for t in (temperature, top_k, top_p, min_p)]}"
            )
        for dst, src, pad in ((self.temperature, temperature, 0.0), (self.top_k, top_k, 1),
                              (self.top_p, top_p, 1.0), (self.min_p, min_p, 0.0)):
            dst[:n].copy_(src, non_blocking=True)
            dst[n:].fill_(pad)


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """What `sample` returns (all [B], on the logits' device).

    token_ids int64: the sampled (or greedy) token of each row.
    exact bool: False where a random row's top-k ties ran past the candidates (the row was
        sampled as if the candidates were the whole tie group): resample it with vLLM's sampler
        or accept the deviation. Always True for greedy rows.
    logprob float32, rank int64 (None unless asked for): vLLM's `raw_logprobs` of the sampled
        token, log_softmax of the raw logits, and its rank (how many tokens have a logprob >=
        it, itself included), as `Sampler.gather_logprobs` reports them.
    """

    token_ids: torch.Tensor
    exact: torch.Tensor
    logprob: torch.Tensor | None = None
    rank: torch.Tensor | None = None


def _candidates(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C largest logits of each row, by value descending and, among ties, token id
    descending: ([B, C] logits in their dtype, [B, C] int64 ids)."""
    values, ids = torch.topk(logits, NUM_CANDIDATES, dim=-1)  # [B, C]; tie order unspecified
    ids, perm = ids.sort(dim=-1, descending=True)  # [B, C]
    values = values.gather(1, perm)
    values, perm = values.sort(dim=-1, descending=True, stable=True)  # ties keep id order
    return values, ids.gather(1, perm)


def filter_candidates(
    logits: torch.Tensor, params: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The random path's distribution, before the race: ([B, C] candidate ids int64, [B, C]
    float32 probabilities, zero where min-p / top-k / top-p dropped the token, [B] bool exact).
    Greedy rows come out as if sampled at temperature 1 (vLLM does the same and then ignores
    them). Public for tests: the probabilities are what vLLM's `random_sample` receives, read
    at the candidates."""
    values, ids = _candidates(logits)  # [B, C]
    temperature = params.temperature.unsqueeze(1)  # [B, 1]
    temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    x = values.float().div_(temperature)  # [B, C]  bitwise vLLM's logits / temperature

    # min-p (vLLM: probs < max_prob * min_p) in exact arithmetic: exp(x - max) < min_p.
    drop_min_p = (x - x[:, :1]).exp_() < params.min_p.unsqueeze(1)  # [B, C]
    # top-k: below the k-th largest; commutes with min-p (both are thresholds on the value).
    k = params.top_k.long().clamp(1, K_CAP).unsqueeze(1) - 1  # [B, 1]  clamp: greedy / padding
    kept = ~drop_min_p & (x >= x.gather(1, k))  # [B, C]
    exact = ~(kept[:, -1] & (x[:, -1] > float("-inf")))  # [B]  the sentinel must not survive
    x = x.masked_fill_(~kept, float("-inf"))

    # top-p, exactly apply_top_k_top_p_pytorch: ascending order, the last (largest) kept.
    x_asc = x.flip(-1)  # [B, C]
    cum = x_asc.softmax(dim=-1, dtype=torch.float32).cumsum_(dim=-1)  # [B, C]
    drop_top_p = cum <= 1 - params.top_p.unsqueeze(1)
    drop_top_p[:, -1] = False
    x = x_asc.masked_fill_(drop_top_p, float("-inf")).flip(-1)  # [B, C] descending again

    greedy = params.temperature < SAMPLING_EPS
    return ids, x.softmax(dim=-1, dtype=torch.float32), exact | greedy


def sample(
    logits: torch.Tensor, params: SamplingTensors, *, logprobs: bool = False
) -> SampledTokens:
    """Sample one token per row of `logits` [B, V] with `params` ([B] device tensors).

    Host work is limited to shape checks; see the module docstring for the semantics and what
    the caller must refuse. `logprobs` adds the sampled token's raw logprob and rank (a [B, V]
    float32 log_softmax: B * V * 4 bytes more from the graph's pool)."""
    if logits.dim() != 2 or logits.shape[1] < NUM_CANDIDATES:
        raise ValueError(
            f"logits must be [B, V] with V >= {NUM_CANDIDATES}, got {tuple(logits.shape)}"
        )
    if params.rows != logits.shape[0]:
        raise ValueError(f"expected {logits.shape[0]} rows of parameters, got {params.rows}")
    if params.temperature.device != logits.device:
        raise ValueError(
            f"parameters on {params.temperature.device}, logits on {logits.device}"
        )
    ids, probs, exact = filter_candidates(logits, params)  # [B, C], [B, C], [B]
    # NOTE: the noise comes from the default generator: under capture, its philox offset
    # advances on every replay; a seeded torch.Generator here would break that.
    noise = torch.empty_like(probs).exponential_()  # [B, C]
    choice = probs.div_(noise).argmax(dim=-1, keepdim=True)  # [B, 1]
    random_ids = ids.gather(1, choice).squeeze(1)  # [B]
    greedy_ids = logits.argmax(dim=-1)  # [B]  the first index among ties, as vLLM's
    token_ids = torch.where(params.temperature < SAMPLING_EPS, greedy_ids, random_ids)
    if not logprobs:
        return SampledTokens(token_ids, exact)
    raw = logits.log_softmax(dim=-1, dtype=torch.float32)  # [B, V]  Sampler.compute_logprobs
    token_logprob = raw.gather(1, token_ids.unsqueeze(1))  # [B, 1]
    rank = (raw >= token_logprob).sum(dim=-1)  # [B]  batched_count_greater_than
    return SampledTokens(token_ids, exact, token_logprob.squeeze(1), rank)
