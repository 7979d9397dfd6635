"""One engine of the numerics test (tests/graphs/numerics.py), run as
`python -m tests.graphs.numerics_engine SPEC.json` in its own interpreter.

The spec: `llm_kwargs`, `prompts` (token ids), `max_tokens`, `seed` of the weight re-draw, and
optionally `score`: {name: sequences} to score by teacher forcing, each sequence the prompt
followed by the generated tokens whose logprobs are wanted (`generated` of them, at its end),
and `score_own`: a name under which the engine scores its own greedy sequences.
Writes to spec["out"]: the greedy `tokens` and the `logprobs` reported for them, the `scores`
([logprob of the token, top-1 logprob, top-1 token] per scored position), the engine config and
the plugin's metrics text.
"""

from __future__ import annotations

import functools
import json
import sys
import time


def _scores(outputs, generated: list[int]) -> list[list[list]]:
    rows = []
    for out, n in zip(outputs, generated, strict=True):
        ids, positions = out.prompt_token_ids, out.prompt_logprobs
        seq = []
        for i in range(len(ids) - n, len(ids)):
            pos, tok = positions[i], ids[i]
            top_tok, top = max(pos.items(), key=lambda kv: kv[1].logprob)
            seq.append([pos[tok].logprob, top.logprob, int(top_tok)])
        rows.append(seq)
    return rows


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.gpu_util import engine_starting, redraw_weights
    from vllm_moe_graphs.metrics_transport import collect_text

    t0 = time.perf_counter()
    with engine_starting():
        llm = LLM(**spec["llm_kwargs"])
    startup_s = round(time.perf_counter() - t0, 1)
    redrawn = llm.apply_model(functools.partial(redraw_weights, seed=spec["seed"]))[0]
    cfg = llm.llm_engine.vllm_config
    greedy = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True,
                            logprobs=1, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], greedy,
                        use_tqdm=False)
    result = {
        "startup_s": startup_s, "redrawn_parameters": redrawn,
        "config": {"worker_cls": cfg.parallel_config.worker_cls,
                   "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
                   "compilation_mode": str(cfg.compilation_config.mode),
                   "attention_backend": str(cfg.attention_config.backend),
                   "quantization": cfg.model_config.quantization,
                   "ir_op_priority": {op: list(getattr(cfg.kernel_config.ir_op_priority, op))
                                      for op in ("rms_norm", "fused_add_rms_norm")}},
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[pos[t].logprob for pos, t in zip(o.outputs[0].logprobs,
                                                        o.outputs[0].token_ids)]
                     for o in outs],
        "scores": {},
    }
    score_params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                                  detokenize=False)
    score = dict(spec.get("score", {}))
    if spec.get("score_own"):
        score[spec["score_own"]] = [{"ids": p + t, "generated": len(t)}
                                    for p, t in zip(spec["prompts"], result["tokens"])]
    for name, seqs in score.items():
        scored = llm.generate([TokensPrompt(prompt_token_ids=s["ids"]) for s in seqs],
                              score_params, use_tqdm=False)
        result["scores"][name] = _scores(scored, [s["generated"] for s in seqs])
    result["metrics"] = collect_text()
    with open(spec["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
