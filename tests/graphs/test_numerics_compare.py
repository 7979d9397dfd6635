"""The numerics comparison (tests/graphs/numerics.py) on hand-made engine results."""

from __future__ import annotations

import pytest

from tests.graphs import numerics


def _results(plugin_lp, plugin_rows, stock_lp, stock_rows, plugin_tokens=None):
    tokens = plugin_tokens or [[5] * len(plugin_lp[0])]
    plugin = {"tokens": tokens, "logprobs": plugin_lp}
    stock = {"tokens": [[5] * len(stock_lp[0])], "logprobs": stock_lp,
             "scores": {"plugin_tokens": plugin_rows, "stock_tokens": stock_rows}}
    return plugin, stock


def test_within_the_floor():
    plugin, stock = _results([[-1.0, -2.0]], [[[-1.01, -1.01, 5], [-2.02, -2.02, 5]]],
                             [[-1.0, -2.0]], [[[-1.01, -1.01, 5], [-2.03, -2.03, 5]]])
    s = numerics.compare(plugin, stock)
    assert s["tokens"] == 2 and s["not_top1"] == 0 and s["identical_sequences"] == 1
    assert s["plugin_mean"] == pytest.approx(0.015) and s["floor_max"] == pytest.approx(0.03)
    assert s["by_step"]["prefill_token"] == pytest.approx({"plugin_mean": 0.01,
                                                           "floor_mean": 0.01})
    assert s["by_step"]["decode_tokens"] == pytest.approx({"plugin_mean": 0.02,
                                                           "floor_mean": 0.03})
    assert numerics.check(s) == []


def test_above_the_floor_and_a_far_second_choice_fail():
    # the plugin's second token is not stock's top-1 and 0.5 nats below it
    plugin, stock = _results([[-1.0, -2.0]], [[[-1.2, -1.2, 5], [-2.5, -2.0, 7]]],
                             [[-1.0, -2.0]], [[[-1.01, -1.01, 5], [-2.01, -2.01, 5]]])
    s = numerics.compare(plugin, stock)
    assert s["not_top1"] == 1 and s["worst_top1_gap"] == pytest.approx(0.5)
    assert s["floor_not_top1"] == 0 and s["floor_worst_top1_gap"] == 0.0
    bad = numerics.check(s)
    assert len(bad) == 3, bad  # mean, largest, top-1 gap


def test_flat_logits_prove_nothing():
    plugin, stock = _results([[-11.9]], [[[-11.9, -11.9, 5]]], [[-11.9]], [[[-11.9, -11.9, 5]]])
    assert any("flat logits" in b for b in numerics.check(numerics.compare(plugin, stock)))


def test_stocks_own_tokens_not_ranked_first_by_its_scoring_are_its_floor():
    # stock's decode chose token 5 where its scoring pass ranks token 9 first, 0.2 nats above
    plugin, stock = _results([[-1.0]], [[[-1.0, -1.0, 5]]], [[-1.0]], [[[-1.1, -0.9, 9]]])
    s = numerics.compare(plugin, stock)
    assert s["not_top1"] == 0
    assert s["floor_not_top1"] == 1 and s["floor_worst_top1_gap"] == pytest.approx(0.2)


def test_variants_diagnose_preset_json_and_bad_values():
    assert numerics.variants(None, "qwen3-0.6b") == {}
    assert numerics.variants(" diagnose ", "qwen3-0.6b") is numerics.DIAGNOSIS
    asked = '{"qwen3-0.6b": {"gemm": {"moe_graphs": {"small_m_gemm": false}}}}'
    assert numerics.variants(asked, "qwen3-0.6b") == {
        "gemm": {"moe_graphs": {"small_m_gemm": False}}}
    assert numerics.variants(asked, "qwen3-30b-a3b") == {}
    with pytest.raises(ValueError, match="neither `diagnose` nor JSON"):
        numerics.variants("diagnos", "qwen3-0.6b")


def test_variant_spec_adds_arguments_and_settings():
    spec = {"llm_kwargs": {"model": "m", "seed": 0}, "prompts": [[1]]}
    stock = numerics.variant_spec(spec, numerics.DIAGNOSIS["stock_eager"])
    assert stock["llm_kwargs"] == {"model": "m", "seed": 0, "enforce_eager": True}
    plugin = numerics.variant_spec(spec, numerics.DIAGNOSIS["cublas_linears"])
    assert plugin["llm_kwargs"]["additional_config"] == {"moe_graphs": {"small_m_gemm": False}}
    assert spec["llm_kwargs"] == {"model": "m", "seed": 0}  # the defaults' spec unchanged
    with pytest.raises(ValueError, match="unknown variant keys"):
        numerics.variant_spec(spec, {"settings": {}})
