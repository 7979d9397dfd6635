"""`moe-graphs doctor` and `moe-graphs demo` on a CPU machine (no CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_moe_graphs.cli import doctor
from vllm_moe_graphs.cli.main import main as cli_main
from vllm_moe_graphs.config import PluginConfig

DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
               "hidden_size": 5120, "num_attention_heads": 128, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "num_hidden_layers": 60, "torch_dtype": "bfloat16"}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
         "torch_dtype": "bfloat16"}


def _config_dir(tmp_path, cfg) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def doctor_shape(name: str):
    from vllm_moe_graphs.model_configs import resolve_model

    import pathlib

    return pathlib.Path(resolve_model(name))


def _reasons(out: str) -> list[str]:
    """The reasons a doctor report lists, in order."""
    return [ln.split()[1] for ln in out.splitlines() if ln.startswith("  - ")]


def _run(capsys, *argv):
    code = cli_main(["doctor", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_qwen3_shape_on_cpu_reports_no_cuda(capsys):
    code, out = _run(capsys, "qwen3-0.6b")
    assert code == doctor.EXIT_NOT_ELIGIBLE
    assert "no_cuda" in out and "fix:" in out
    assert "unsupported_architecture" not in out


def test_deepseek_v2_reports_mla(capsys, tmp_path):
    code, out = _run(capsys, _config_dir(tmp_path, DEEPSEEK_V2))
    assert code == doctor.EXIT_NOT_ELIGIBLE
    assert "mla_layout_unsupported" in out and "no_cuda" in out
    assert "unsupported_architecture" not in out


def test_llama_reports_unsupported_architecture(capsys, tmp_path):
    code, out = _run(capsys, _config_dir(tmp_path, LLAMA))
    assert code == doctor.EXIT_NOT_ELIGIBLE
    assert "unsupported_architecture" in out and "LlamaForCausalLM" in out


@pytest.mark.parametrize("flags,reason", [
    (["-pp", "2"], "pipeline_parallel"),
    (["--enable-lora"], "lora"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     "speculative_decoding"),
    (["--enforce-eager"], "enforce_eager"),
    (["--kv-cache-dtype", "fp8"], "unsupported_dtype"),
    (["--calculate-kv-scales"], "unsupported_dtype (dtype=bfloat16, kv_cache_dtype=auto, "
                                "--calculate-kv-scales"),
    (["--dtype", "float32"], "unsupported_dtype"),
    (["--offload-group-size", "4", "--offload-num-in-group", "1"], "offload_not_graph_safe"),
    (["--additional-config", '{"moe_graphs": {"enabled": false}}'], "disabled_by_config"),
    (["--quantization", "awq"], "unsupported_quantization (quantization awq)"),
    (["--runner", "pooling"], "pooling_runner (runner pooling)"),
    (["--convert", "embed"], "pooling_runner (runner pooling)"),
    (["-dp", "2"], "data_parallel (data_parallel_size=2 with an MoE model)"),
    (["--data-parallel-size", "4"], "data_parallel (data_parallel_size=4 with an MoE model)"),
    (["-O3"], "user_compilation (-O3)"),
    (["-O", "1"], "user_compilation (-O1)"),
    (["--optimization-level", "0"], "user_compilation (-O0)"),
    (["-cc.cudagraph_mode=FULL_DECODE_ONLY"],
     "user_compilation (-cc.cudagraph_mode=FULL_DECODE_ONLY)"),
    (["-cc.mode", "VLLM_COMPILE"], "user_compilation (-cc.mode=VLLM_COMPILE)"),
    (["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'],
     "user_compilation (-cc.cudagraph_mode=PIECEWISE)"),
])
def test_engine_flags_map_to_reasons(capsys, flags, reason):
    code, out = _run(capsys, "qwen3-30b-a3b", *flags)
    assert code == doctor.EXIT_NOT_ELIGIBLE
    assert reason in out
    assert "not read" not in out  # every flag that decides eligibility is read


@pytest.mark.parametrize("flags", [
    ["-dp", "2"],  # a dense model's data-parallel ranks are independent engines
    ["-O2"],  # vLLM's default level
    ["-cc.mode=NONE", "-cc.cudagraph_mode=NONE"],  # the plugin's explicit route
    ["--compilation-config", '{"mode": "NONE"}'],
    ["--runner", "generate"],
])
def test_settings_the_plugin_takes(capsys, flags):
    code, out = _run(capsys, "qwen3-0.6b", *flags)
    assert _reasons(out) == ["no_cuda"], out  # the only reason on a CPU machine
    assert "not read" not in out


def test_sliding_window_checkpoint(capsys, tmp_path):
    hf = json.loads((doctor_shape("qwen3-0.6b") / "config.json").read_text())
    hf.update(use_sliding_window=True, sliding_window=4096)
    model = _config_dir(tmp_path, hf)
    code, out = _run(capsys, model)
    assert "sliding_window (sliding window of 4096 tokens)" in out
    assert "--disable-sliding-window" in out  # the fix
    code, out = _run(capsys, model, "--disable-sliding-window")
    assert _reasons(out) == ["no_cuda"], out
    assert "decode graphs cover every context up to max_model_len 4096" in out  # vLLM's cap
    hf.update(use_sliding_window=False)  # transformers drops the window then
    code, out = _run(capsys, _config_dir(tmp_path, hf))
    assert _reasons(out) == ["no_cuda"], out
    code, out = _run(capsys, _config_dir(tmp_path, hf), "--disable-sliding-window")
    assert "decode graphs cover every context up to max_model_len 40960" in out  # no cap


def test_sentence_transformers_checkpoint_is_a_pooling_model(capsys, tmp_path):
    # e.g. Qwen3-Embedding: a Qwen3ForCausalLM config with sentence-transformers modules,
    # which vLLM runs as a pooling model without any flag
    hf = json.loads((doctor_shape("qwen3-0.6b") / "config.json").read_text())
    model = _config_dir(tmp_path, hf)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hf["hidden_size"], "pooling_mode_lasttoken": True}))
    code, out = _run(capsys, model)
    assert "pooling_runner (runner pooling)" in out


def test_contexts_past_the_largest_bucket(capsys):
    code, out = _run(capsys, "qwen3-0.6b", "--max-model-len", "262144")
    assert ("decode steps whose context is past 131072 tokens (up to max_model_len 262144) run "
            "eager (context_too_long): add 262144 to context_buckets") in out
    assert "not read" not in out
    code, out = _run(capsys, "qwen3-0.6b", "--max_model_len=256k", "--additional-config",
                     '{"moe_graphs": {"context_buckets": [2048, 8192, 32768, 131072, 262144]}}')
    assert "past 262144 tokens (up to max_model_len 256000)" not in out
    assert "decode graphs cover every context up to max_model_len 256000" in out
    code, out = _run(capsys, "qwen3-0.6b")  # the checkpoint's 40960 positions
    assert "decode graphs cover every context up to max_model_len 40960" in out
    code, out = _run(capsys, "qwen3-0.6b", "--max-model-len", "lots")
    assert code == doctor.EXIT_BAD_INPUT and "--max-model-len 'lots'" in out


@pytest.mark.parametrize("argv,expected", [
    (["-O3"], ["--optimization-level", "3"]),
    (["-O=1"], ["--optimization-level", "1"]),
    (["-O", "0"], ["--optimization-level", "0"]),
    (["--max_model_len=8k", "--enable_lora"], ["--max-model-len=8k", "--enable-lora"]),
    (["-cc.mode=NONE", "-cc.cudagraph_mode", "FULL", "--compilation-config.pass_config.x=1"],
     ["--compilation-config",
      '{"mode": "NONE", "cudagraph_mode": "FULL", "pass_config": {"x": 1}}']),
])
def test_flags_spelled_as_vllm_serve_reads_them(argv, expected):
    assert doctor.normalise_flags(argv) == expected


def test_uva_expert_offload_is_not_a_deny(capsys):
    code, out = _run(capsys, "qwen3-30b-a3b", "--cpu-offload-gb", "8",
                     "--cpu-offload-params", "experts", "-tp", "2")
    assert "offload_not_graph_safe" not in out
    assert "no_cuda" in out  # the only reason on a CPU machine


def test_uva_disabled_offload_is_denied(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_WEIGHT_OFFLOADING_DISABLE_UVA", "1")
    code, out = _run(capsys, "qwen3-30b-a3b", "--cpu-offload-gb", "8")
    assert "offload_not_graph_safe" in out


def test_unread_flags_are_listed(capsys):
    code, out = _run(capsys, "qwen3-0.6b", "--served-model-name", "chat")
    assert "not read (do not affect eligibility): --served-model-name chat" in out


def test_bad_plugin_config_exits_2(capsys):
    code, out = _run(capsys, "qwen3-0.6b", "--additional-config",
                     '{"moe_graphs": {"graph_memory_budget_mib": -1}}')
    assert code == doctor.EXIT_BAD_INPUT
    assert "graph_memory_budget_mib" in out and "-1" in out


def test_missing_config_dir_exits_2(capsys, tmp_path):
    code, out = _run(capsys, str(tmp_path / "nothing"))
    assert code == doctor.EXIT_BAD_INPUT
    assert "config.json" in out


def test_unknown_command_and_usage(capsys):
    assert cli_main(["frobnicate"]) == 2
    assert cli_main(["--help"]) == 0
    assert "doctor" in capsys.readouterr().out


def test_console_script_and_demo_without_gpu():
    """The installed console script; the demo on a CPU machine says so and shows doctor."""
    proc = subprocess.run([sys.executable, "-m", "vllm_moe_graphs.cli.main", "demo"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]  # documented; 2 is bad input
    assert "no CUDA GPU" in proc.stdout
    assert "no_cuda" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_doctor_report_on_stdout_and_vllm_log_on_stderr():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_STREAM"}
    proc = subprocess.run([sys.executable, "-m", "vllm_moe_graphs.cli.main", "doctor",
                           "qwen3-0.6b"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == doctor.EXIT_NOT_ELIGIBLE, proc.stderr[-2000:]
    assert proc.stdout.startswith("moe-graphs doctor (vllm_moe_graphs"), proc.stdout[:500]
    assert not [ln for ln in proc.stdout.splitlines() if ln.startswith(("INFO", "WARNING"))]
    assert "registered in process" in proc.stderr  # vLLM's logger (and ours through it)


def test_doctor_help_answers_without_importing_vllm():
    code = ("import sys\nfrom vllm_moe_graphs.cli.main import main\ntry:\n"
            "    main(['doctor', '--help'])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('EXIT', code, 'vllm' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "MODEL_OR_CONFIG_DIR" in proc.stdout
    assert proc.stdout.strip().endswith("EXIT 0 False"), proc.stdout[-500:] + proc.stderr[-2000:]


def test_demo_rejects_bad_numbers(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["demo", "--batch", "0"])
    assert exc.value.code == 2
    assert "--batch=0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["demo", "--kv-cache-memory-bytes", "-1"])
    assert exc.value.code == 2
    assert "--kv-cache-memory-bytes=-1" in capsys.readouterr().err


def test_demo_reads_label_values_from_the_metrics_text():
    from vllm_moe_graphs.cli.demo import _series

    text = ('moe_graphs_capability{reason="eligible"} 1.0\n'
            'moe_graphs_capability{reason="no_cuda"} 0.0\n'
            'moe_graphs_eager_fallbacks_total{rank="0",reason="mixed_batch"} 3.0\n'
            'moe_graphs_replays_total{rank="0"} 13.0\n')
    assert _series(text, "moe_graphs_capability") == [("eligible", 1.0), ("no_cuda", 0.0)]
    assert _series(text, "moe_graphs_eager_fallbacks_total") == [("mixed_batch", 3.0)]
    assert _series(text, "moe_graphs_replays_total") == [("", 13.0)]
    assert _series(text, "moe_graphs_replays_total", label="rank") == [("0", 13.0)]


def test_doctor_says_how_steps_with_prefill_tokens_run(capsys):
    code, out = _run(capsys, "qwen3-0.6b")
    assert ("steps with prefill tokens: graphed, one graph per query-token bucket (33 buckets, "
            "16..8192 tokens") in out
    # the default asks for FlashAttention 3, which a CPU machine has not
    assert ("their attention: the plugin's Triton kernel (prefill_attention auto: "
            "FlashAttention 3 is not available on this machine: ") in out
    code, out = _run(capsys, "qwen3-0.6b", "--additional-config",
                     '{"moe_graphs": {"token_buckets": [64, 512]}}')
    assert ("steps with prefill tokens: graphed, one graph per query-token bucket (2 buckets, "
            "64..512 tokens") in out
    code, out = _run(capsys, "qwen3-0.6b", "--additional-config",
                     '{"moe_graphs": {"mixed_graphs": false}}')
    assert "steps with prefill tokens: eager (mixed_graphs is off" in out


def test_doctor_says_when_graphs_are_captured(capsys):
    code, out = _run(capsys, "qwen3-0.6b")
    assert ("graphs are captured: while the engine waits for requests (idle_capture), or lazily "
            "on a key's first use after 1 eager warm-up step(s), whichever comes first") in out
    assert doctor.capture_lines(PluginConfig(idle_capture=False)) == [
        "graphs are captured: lazily, on a key's first use after 1 eager warm-up step(s) "
        "(idle_capture is off; \"idle_capture\": true captures them while the engine waits for "
        "requests, \"precapture\": true at start-up)"]
    assert doctor.capture_lines(PluginConfig(precapture=True, idle_capture=True)) == [
        "graphs are captured: all at start-up (precapture)"]


def test_doctor_says_who_samples(capsys):
    code, out = _run(capsys, "qwen3-0.6b")
    assert "sampling: vLLM's sampler after each step" in out and "sample_in_graph" in out
    code, out = _run(capsys, "qwen3-0.6b", "--additional-config",
                     '{"moe_graphs": {"sample_in_graph": true}}')
    line = next(ln for ln in out.splitlines() if ln.startswith("sampling:"))
    assert "from CUDA graphs (sample_in_graph)" in line and "seeds, logprobs" in line, line


@pytest.mark.parametrize("section,problem,kernel", [
    ({}, None, "FlashAttention 3 (prefill_attention auto)"),
    ({"prefill_attention": "flash_attn"}, None, "FlashAttention 3 (prefill_attention flash_attn)"),
    ({"prefill_attention": "triton"}, None,
     "the plugin's Triton kernel (prefill_attention triton)"),
    ({"prefill_attention": "triton"}, "no GPU",
     "the plugin's Triton kernel (prefill_attention triton)"),
    ({"prefill_attention": "flash_attn"}, "no GPU", "the plugin's Triton kernel "
     "(prefill_attention flash_attn: FlashAttention 3 is not available on this machine: no GPU)"),
])
def test_prefill_attention_line_follows_config_and_machine(section, problem, kernel):
    lines = doctor.prefill_steps_lines(PluginConfig.from_dict(section), problem)
    assert lines[1] == f"  their attention: {kernel}", lines


def test_doctor_says_whether_moe_padding_rows_skip_the_experts(capsys):
    code, out = _run(capsys, "qwen3-30b-a3b")
    assert "padding rows of padded steps: skip the experts wherever vLLM runs its Triton" in out
    assert "their expert ids written by one mask launch per MoE layer" in out
    code, out = _run(capsys, "qwen3-30b-a3b", "--additional-config",
                     '{"moe_graphs": {"fuse_moe_padding_mask": true}}')
    assert "ids written by the plugin's routing kernel (fuse_moe_padding_mask)" in out
    code, out = _run(capsys, "qwen3-30b-a3b", "--additional-config",
                     '{"moe_graphs": {"skip_moe_padding": false}}')
    assert ("padding rows of padded steps: routed through the experts like real tokens "
            "(skip_moe_padding is off") in out
    code, out = _run(capsys, "qwen3-0.6b")
    assert "padding rows" not in out  # a dense model has no experts
    assert doctor.moe_padding_lines(PluginConfig(skip_moe_padding=True), 64) == [
        "padding rows of padded steps: routed through the experts like real tokens: 64 experts "
        "(skipping them needs more than 64)"]


def test_doctor_says_where_the_graph_pool_memory_comes_from(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", raising=False)
    code, out = _run(capsys, "qwen3-0.6b", "--gpu-memory-utilization", "0.8")
    assert ("graph memory: a pool of up to 2048 MiB (graph_memory_budget_mib), taken out of the "
            "KV cache memory within --gpu-memory-utilization 0.8") in out
    assert "not read" not in out  # the memory flags are doctor's own
    code, out = _run(capsys, "qwen3-0.6b", "--kv-cache-memory-bytes", "8000000000",
                     "--additional-config", '{"moe_graphs": {"graph_memory_budget_mib": 512}}')
    assert ("up to 512 MiB (graph_memory_budget_mib), not taken out of the KV cache "
            "(--kv-cache-memory-bytes 8000000000 sizes it)") in out
    monkeypatch.setenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "0")
    code, out = _run(capsys, "qwen3-0.6b")
    assert "not taken out of the KV cache (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0)" in out
    assert doctor.memory_lines(PluginConfig(graph_memory_budget_mib=0), 0.9, None, True) == [
        "graph memory: none (graph_memory_budget_mib 0: every capture is denied, steps run "
        "eager with memory_budget)"]


def test_unproven_fp8_kv_is_taken_over_and_said(capsys, monkeypatch):
    monkeypatch.setenv("MOE_GRAPHS_UNPROVEN", "fp8_kv")
    code, out = _run(capsys, "qwen3-30b-a3b", "--kv-cache-dtype", "fp8")
    assert "unsupported_dtype" not in out
    assert ("MOE_GRAPHS_UNPROVEN: an FP8 KV cache (kv_cache_dtype fp8) taken over, not yet "
            "proven") in out


def test_unproven_is_not_said_where_another_reason_refuses(capsys, monkeypatch):
    monkeypatch.setenv("MOE_GRAPHS_UNPROVEN", "fp8_kv")
    code, out = _run(capsys, "qwen3-30b-a3b", "--kv-cache-dtype", "fp8", "-pp", "2")
    assert code == doctor.EXIT_NOT_ELIGIBLE and "pipeline_parallel" in out
    assert "MOE_GRAPHS_UNPROVEN" not in out

