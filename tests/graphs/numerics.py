"""The plugin's numerics against stock vLLM's, by teacher forcing (the GPU test:
tests/graphs/test_gpu_numerics.py; the comparison is checked on the CPU too).

Both engines load the same re-drawn weights (`tests.gpu_util.redraw_weights`, seeded per
parameter name). The plugin generates greedy tokens with their logprobs; stock vLLM (the plugin
rolled back with MOE_GRAPHS_DISABLE=1) then scores the plugin's sequences as prompts
(`prompt_logprobs`): the logprob stock assigns to each token the plugin chose, beside the one
the plugin reported. Stock's own noise floor is the same comparison on stock's greedy tokens:
what stock reported while generating (its decode path) against what its scoring pass assigns
(its prefill path). `compare` turns the four runs into the numbers the test bounds.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time

from tests.gpu_util import REPO, engine_env

# Bounds against stock's own floor (the plugin's |difference| mean and max over stock's), and
# the largest logprob gap of a token the plugin chose that stock does not rank first.
MEAN_FACTOR, MAX_FACTOR, TOP1_GAP_NATS = 1.5, 2.0, 0.1
INFORMATIVE_TOP1_LOGPROB = -10.5  # flat logits (vLLM's raw dummy weights) sit at -ln V

# To find where a difference comes from: {shape: {name: variant}} in this variable runs one
# more engine per entry, each scored by the same stock engine and reported beside the defaults
# (not asserted). A variant: {"moe_graphs": settings} (the plugin with these settings, e.g.
# {"small_m_gemm": false}), {"stock": true} (the plugin rolled back), and "llm_kwargs" added to
# the engine's arguments (e.g. {"stock": true, "llm_kwargs": {"enforce_eager": true}}: stock
# vLLM without torch.compile or graphs). The value `diagnose` runs DIAGNOSIS on every shape:
# stock uncompiled (does torch.compile make the difference?), the plugin with each of its own
# kernels in the forward turned back to vLLM's, with `compiled_numerics` (RMSNorm and SiLU-and-mul
# rounded as stock's compiled model), and with vLLM's RMSNorm IR ops on their `native` torch
# provider (stock's code, run uncompiled).
VARIANTS_ENV = "MOE_GRAPHS_TEST_NUMERICS_VARIANTS"
DIAGNOSIS = {
    "stock_eager": {"stock": True, "llm_kwargs": {"enforce_eager": True}},
    "unfused_qk_norm_rope": {"moe_graphs": {"fuse_qk_norm_rope": False}},
    "cublas_linears": {"moe_graphs": {"small_m_gemm": False}},
    "logits_after_forward": {"moe_graphs": {"logits_in_graph": False}},
    "compiled_numerics": {"moe_graphs": {"compiled_numerics": True}},
    "native_norms": {"llm_kwargs": {"ir_op_priority": {"rms_norm": ["native"],
                                                       "fused_add_rms_norm": ["native"]}}},
}


def variants(text: str | None, shape: str) -> dict[str, dict]:
    """The variants `text` (VARIANTS_ENV's value) asks for on `shape`."""
    text = (text or "").strip() or "{}"
    if text == "diagnose":
        return DIAGNOSIS
    try:
        asked = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{VARIANTS_ENV}={text!r} is neither `diagnose` nor JSON "
                         f"{{shape: {{name: variant}}}}: {e}") from None
    return asked.get(shape, {})


def variant_spec(spec: dict, variant: dict) -> dict:
    """`spec` for one variant's engine: its `llm_kwargs` added, its `moe_graphs` settings as
    the engine's additional_config."""
    unknown = set(variant) - {"stock", "moe_graphs", "llm_kwargs"}
    if unknown:
        raise ValueError(f"unknown variant keys {sorted(unknown)}; a variant takes `stock`, "
                         "`moe_graphs` and `llm_kwargs`")
    kwargs = {**spec["llm_kwargs"], **variant.get("llm_kwargs", {})}
    if "moe_graphs" in variant:
        kwargs["additional_config"] = {"moe_graphs": variant["moe_graphs"]}
    return {**spec, "llm_kwargs": kwargs}


def prompts(vocab: int, n: int = 16, seed: int = 0) -> list[list[int]]:
    """`n` prompts of 16-250 random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(16 + (i * 37) % 235)]
            for i in range(n)]


def run(tmp_path, name: str, spec: dict, *, plugin: bool, timeout_s: float,
        env_extra: dict[str, str] | None = None) -> dict:
    """One engine (`tests.graphs.numerics_engine`) in its own interpreter on `spec`; with
    `plugin` False the plugin is rolled back (MOE_GRAPHS_DISABLE=1): stock vLLM. `env_extra`:
    more environment (e.g. MOE_GRAPHS_UNPROVEN for the plugin's engine)."""
    out = tmp_path / f"{name}.json"
    spec_file = tmp_path / f"{name}.spec.json"
    spec_file.write_text(json.dumps({**spec, "out": str(out)}))
    env = engine_env(**({} if plugin else {"MOE_GRAPHS_DISABLE": "1"}), **(env_extra or {}))
    log = tmp_path / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "tests.graphs.numerics_engine",
                               str(spec_file)], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout_s)
    text = log.read_text()
    assert proc.returncode == 0 and out.exists(), (
        f"{name} engine failed (exit {proc.returncode}):\n{text[-8000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["log_lines"] = [ln for ln in text.splitlines() if "moe_graphs" in ln][:40]
    return result


def _diffs(reported: list[list[float]], scored: list[list[list]],
           positions: slice = slice(None)) -> list[float]:
    """|reported - scored| per generated token at `positions` of each sequence."""
    return [abs(lp - row[0]) for seq_lp, seq_rows in zip(reported, scored, strict=True)
            for lp, row in zip(seq_lp[positions], seq_rows[positions], strict=True)]


def _by_step(plugin: dict, stock: dict) -> dict:
    """The mean |difference| of the first generated token (the prefill step's) and of the
    rest (decode steps), the plugin's and the floor's: which path a difference comes from."""
    out = {}
    for name, pos in (("prefill_token", slice(0, 1)), ("decode_tokens", slice(1, None))):
        ours = _diffs(plugin["logprobs"], stock["scores"]["plugin_tokens"], pos)
        floor = _diffs(stock["logprobs"], stock["scores"]["stock_tokens"], pos)
        if ours and floor:
            out[name] = {"plugin_mean": statistics.fmean(ours),
                         "floor_mean": statistics.fmean(floor)}
    return out


def _not_top1(tokens: list[list[int]], scored: list[list[list]]) -> list[float]:
    """The scoring pass's top-1 logprob minus the token's, for every generated token that pass
    does not rank first."""
    return [row[1] - row[0] for seq, rows in zip(tokens, scored, strict=True)
            for tok, row in zip(seq, rows, strict=True) if row[2] != tok]


def compare(plugin: dict, stock: dict) -> dict:
    """The numbers of one shape. `plugin` and `stock` are the engines' results: `tokens` and
    `logprobs` (each generated sequence, the logprob each engine reported for its own token),
    and stock's `scores` of `plugin_tokens` and `stock_tokens` ([logprob of the token, logprob
    of stock's top-1, stock's top-1 token] per generated position). The `floor_` numbers are
stock's own: its greedy tokens (its decode path) against its scoring pass (its prefill path)."""
    ours = _diffs(plugin["logprobs"], stock["scores"]["plugin_tokens"])
    floor = _diffs(stock["logprobs"], stock["scores"]["stock_tokens"])
    not_top1 = _not_top1(plugin["tokens"], stock["scores"]["plugin_tokens"])
    floor_not_top1 = _not_top1(stock["tokens"], stock["scores"]["stock_tokens"])
    same = sum(a == b for a, b in zip(plugin["tokens"], stock["tokens"], strict=True))
    return {
        "tokens": len(ours),
        "plugin_mean": statistics.fmean(ours), "plugin_max": max(ours),
        "floor_mean": statistics.fmean(floor), "floor_max": max(floor),
        "not_top1": len(not_top1), "worst_top1_gap": max(not_top1, default=0.0),
        "floor_not_top1": len(floor_not_top1),
        "floor_worst_top1_gap": max(floor_not_top1, default=0.0),
        "identical_sequences": same, "sequences": len(plugin["tokens"]),
        "by_step": _by_step(plugin, stock),
        "mean_top1_logprob": statistics.fmean(
            row[1] for rows in stock["scores"]["stock_tokens"] for row in rows),
    }


def check(summary: dict) -> list[str]:
    """What breaks the bounds (empty: within them)."""
    s, bad = summary, []
    if s["plugin_mean"] > MEAN_FACTOR * s["floor_mean"]:
        bad.append(f"mean |difference| {s['plugin_mean']:.4f} nats > {MEAN_FACTOR}x stock's "
                   f"floor {s['floor_mean']:.4f}")
    if s["plugin_max"] > MAX_FACTOR * s["floor_max"]:
        bad.append(f"largest |difference| {s['plugin_max']:.4f} nats > {MAX_FACTOR}x stock's "
                   f"floor {s['floor_max']:.4f}")
    if s["worst_top1_gap"] > TOP1_GAP_NATS:
        bad.append(f"a token the plugin chose is {s['worst_top1_gap']:.4f} nats below stock's "
                   f"top-1 (bound {TOP1_GAP_NATS}; {s['not_top1']} of {s['tokens']} tokens "
                   "not stock's top-1)")
    if s["mean_top1_logprob"] < INFORMATIVE_TOP1_LOGPROB:
        bad.append(f"flat logits (mean top-1 logprob {s['mean_top1_logprob']:.2f}): the "
                   "comparison would prove nothing")
    return bad
