from __future__ import annotations

import pytest

from vllm_moe_graphs.config import CaptureFailurePolicy, PluginConfig


def test_defaults_when_absent():
    assert PluginConfig.from_additional_config(None) == PluginConfig()
    assert PluginConfig.from_additional_config({"other_plugin": {}}) == PluginConfig()


def test_parses_every_field():
    cfg = PluginConfig.from_additional_config({"moe_graphs": {
        "enabled": False, "decode_batch_buckets": [1, 4, 16], "context_buckets": [512, 4096],
        "warmup_steps": 0, "graph_memory_budget_mib": 512, "capture_failure_policy": "raise",
        "precapture": True}})
    assert cfg.enabled is False
    assert cfg.decode_batch_buckets == (1, 4, 16)
    assert cfg.context_buckets == (512, 4096)
    assert cfg.warmup_steps == 0
    assert cfg.graph_memory_budget_mib == 512
    assert cfg.capture_failure_policy is CaptureFailurePolicy.RAISE
    assert cfg.precapture is True
    assert PluginConfig.from_dict(cfg.to_dict()) == cfg
    mixed = PluginConfig.from_dict({"mixed_graphs": True, "token_buckets": [64, 512, 8192]})
    assert mixed.mixed_graphs is True and mixed.token_buckets == (64, 512, 8192)
    assert PluginConfig.from_dict(mixed.to_dict()) == mixed
    assert PluginConfig().mixed_graphs is True  # every step kind graphed by default
    assert PluginConfig.from_dict({"mixed_graphs": False}).mixed_graphs is False
    fa3 = PluginConfig.from_dict({"prefill_attention": "flash_attn"})
    assert fa3.prefill_attention == "flash_attn" and PluginConfig.from_dict(fa3.to_dict()) == fa3
    assert PluginConfig().prefill_attention == "auto"
    assert PluginConfig.from_dict({"prefill_attention": "triton"}).prefill_attention == "triton"
    assert PluginConfig().warm_up_compile_threads == 8  # fused-MoE compiles on 8 threads
    serial = PluginConfig.from_dict({"warm_up_compile_threads": 0})
    assert serial.warm_up_compile_threads == 0 and PluginConfig.from_dict(
        serial.to_dict()) == serial


def test_frozen():
    with pytest.raises(AttributeError):
        PluginConfig().warmup_steps = 3  # type: ignore[misc]


def test_default_buckets_sorted_and_positive():
    cfg = PluginConfig()
    for buckets in (cfg.decode_batch_buckets, cfg.context_buckets, cfg.token_buckets):
        assert list(buckets) == sorted(set(buckets)) and buckets[0] > 0


def test_default_token_buckets_bound_the_padding():
    """The default ladder covers `vllm serve`'s 8192-token step budget on the H200 and pads a
    step of more than 256 tokens by less than a quarter, of more than 2048 by less than an
    eighth (config.TOKEN_BUCKETS says why)."""
    buckets = PluginConfig().token_buckets
    assert buckets[0] == 16 and buckets[-1] == 8192
    for lo, hi in zip(buckets, buckets[1:]):
        waste = (hi - lo - 1) / hi  # a step of lo + 1 tokens pads to hi
        assert waste < (0.5 if hi <= 256 else 0.25 if hi <= 2048 else 0.125), (lo, hi)


@pytest.mark.parametrize("section,needles", [
    ({"graph_budget": 3}, ["moe_graphs.graph_budget", "3", "allowed keys", "graph_memory_budget_mib"]),
    ({"warmup_steps": "2"}, ["moe_graphs.warmup_steps", "'2'", "integer"]),
    ({"warmup_steps": 2.5}, ["moe_graphs.warmup_steps", "2.5", "integer"]),
    ({"warmup_steps": True}, ["moe_graphs.warmup_steps", "True", "integer"]),
    ({"warmup_steps": -1}, ["moe_graphs.warmup_steps", "-1", ">= 0"]),
    ({"mixed_requests": 0}, ["moe_graphs.mixed_requests", "0", ">= 1"]),
    ({"warm_up_compile_threads": -2}, ["moe_graphs.warm_up_compile_threads", "-2", ">= 0"]),
    ({"warm_up_compile_threads": "8"}, ["moe_graphs.warm_up_compile_threads", "'8'", "integer"]),
    ({"graph_memory_budget_mib": -5}, ["moe_graphs.graph_memory_budget_mib", "-5", ">= 0"]),
    ({"enabled": "yes"}, ["moe_graphs.enabled", "'yes'", "true or false"]),
    ({"precapture": 1}, ["moe_graphs.precapture", "1", "true or false"]),
    ({"decode_batch_buckets": [4, 2, 8]}, ["moe_graphs.decode_batch_buckets", "[4, 2, 8]",
                                           "strictly increasing", "[2, 4, 8]"]),
    ({"decode_batch_buckets": [1, 2, 2]}, ["moe_graphs.decode_batch_buckets", "strictly"]),
    ({"decode_batch_buckets": [0, 1]}, ["moe_graphs.decode_batch_buckets", "entry 0",
                                        "positive"]),
    ({"context_buckets": [-1024, 2048]}, ["moe_graphs.context_buckets", "-1024", "positive"]),
    ({"context_buckets": []}, ["moe_graphs.context_buckets", "non-empty"]),
    ({"context_buckets": 4096}, ["moe_graphs.context_buckets", "4096", "list"]),
    ({"context_buckets": [1.5]}, ["moe_graphs.context_buckets", "1.5", "positive integer"]),
    ({"token_buckets": [64, 32]}, ["moe_graphs.token_buckets", "strictly increasing"]),
    ({"mixed_graphs": "on"}, ["moe_graphs.mixed_graphs", "'on'", "true or false"]),
    ({"prefill_attention": "fa3"}, ["moe_graphs.prefill_attention", "'fa3'", "flash_attn"]),
    ({"capture_failure_policy": "ignore"}, ["moe_graphs.capture_failure_policy", "'ignore'",
                                            "quarantine"]),
])
def test_bad_input_names_key_value_and_allowed(section, needles):
    with pytest.raises(ValueError) as err:
        PluginConfig.from_additional_config({"moe_graphs": section})
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_section_must_be_object():
    with pytest.raises(ValueError, match="must be a JSON object"):
        PluginConfig.from_additional_config({"moe_graphs": [1, 2]})


def test_parsed_once_per_process_and_section():
    from vllm_moe_graphs.config import plugin_config

    a = plugin_config({"moe_graphs": {"warmup_steps": 3, "precapture": True}})
    assert a is plugin_config({"moe_graphs": {"precapture": True, "warmup_steps": 3}})
    assert a.warmup_steps == 3 and a.precapture
    assert plugin_config(None) is plugin_config({}) is plugin_config({"other": 1})
    assert plugin_config(None) == PluginConfig()
    assert plugin_config({"moe_graphs": {"warmup_steps": 4}}) is not a
    with pytest.raises(ValueError, match="unknown key moe_graphs.warmup"):
        plugin_config({"moe_graphs": {"warmup": 3}})
