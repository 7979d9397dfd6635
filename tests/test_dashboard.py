"""Guards examples/grafana/moe_graphs_dashboard.json: every series its PromQL queries is one that
really exists (`moe_graphs_*`: exported by the plugin's own metric code; `vllm:*`: defined in the
installed vLLM), and every label it filters or groups `moe_graphs_*` series by is one they carry.
A renamed metric or label would otherwise leave a silently empty panel."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest
from prometheus_client import CollectorRegistry

from vllm_moe_graphs.metrics import METRICS, PREFIX, MetricsRecorder
from vllm_moe_graphs.metrics_transport import PluginCollector

REPO = pathlib.Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "examples" / "grafana" / "moe_graphs_dashboard.json"

# -- a small PromQL reference extractor (enough for this dashboard, not a parser) -------------
_RANGE = re.compile(r"\[[^\]]*\]")  # [5m], [$__rate_interval]: durations and Grafana variables
_BRACES = re.compile(r"\{[^}]*\}")  # label matchers: their label names are not series
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}")  # name{matchers}
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:\\.|[^"\\])*)"')
# An identifier not glued to a word, `:`, `$` or `.` before it (`5m`, `0.99`), taken whole (no
# backtracking into a prefix: `(?![\w:])`) and not a function call (`(?!\s*\()`). What is left
# after removing strings, matchers, ranges and grouping clauses is a series name or a keyword.
_IDENTIFIER = re.compile(r"(?<![\w:$.])[A-Za-z_:][\w:]*(?![\w:])(?!\s*\()")
# Aggregations and operators written without a `(` right after them (`sum by (x) (...)`).
_KEYWORDS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk",
             "quantile", "count_values", "and", "or", "unless", "bool", "offset", "inf", "nan"}
# Exposed-name suffixes vLLM's metrics gain over the name in their source (Counter: _total,
# Histogram: _bucket/_sum/_count). Hazard: for vLLM we do not know each metric's type, so
# this check is looser than ours (it would accept `_total` on a gauge).
_VLLM_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
# Labels whose values depend on the deployment (the fixture sees rank 0 and this version only).
_FREE_VALUES = ("rank", "version")


def series_names(expr: str) -> set[str]:
    bare = _RANGE.sub("", _BRACES.sub("", _GROUPING.sub("", expr)))
    return {n for n in _IDENTIFIER.findall(bare) if n.lower() not in _KEYWORDS}


def grouping_labels(expr: str) -> set[str]:
    clauses = _GROUPING.findall(expr)
    return {label.strip() for clause in clauses for label in clause.split(",") if label.strip()}


Exported = dict[str, dict[str, set[str]]]  # exposed sample name -> label -> values seen


def problems(expr: str, exported: Exported, vllm_names: set[str]) -> list[str]:
    """What is wrong with `expr`: unknown series, labels a `moe_graphs_*` series lacks, or an
    exact-match label value it never takes. Empty when the query can find data."""
    found: list[str] = []
    ours = {n for n in series_names(expr) if n.startswith(PREFIX)}
    for name in series_names(expr) - ours:
        if not name.startswith("vllm:"):
            found.append(f"{name}: neither {PREFIX}* nor vllm:*")
        elif name not in vllm_names and not any(
                name.endswith(s) and name.removesuffix(s) in vllm_names for s in _VLLM_SUFFIXES):
            found.append(f"{name}: not defined in the installed vLLM's v1/metrics")
    found += [f"{name}: not exported by the plugin" for name in ours if name not in exported]
    # Hazard: a grouping label a series lacks does not fail in Prometheus, it merges every series
    # into one group with an empty label; so each one must be on every plugin series of the expr.
    for name in ours & exported.keys():
        found += [f"{name}: no label {label!r}" for label in grouping_labels(expr)
                  if label not in exported[name]]
    for name, matchers in _SELECTOR.findall(expr):
        for label, op, value in _MATCHER.findall(matchers):
            if name not in exported:
                continue
            if label not in exported[name]:
                found.append(f"{name}: no label {label!r}")
            elif op == "=" and label not in _FREE_VALUES and value not in exported[name][label]:
                found.append(f"{name}: label {label} never takes {value!r}")
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Exported:
    """Exposed sample name -> label -> values, as the API server's `/metrics` shows them: the
    plugin's real recorder writes its files (it creates every label child up front) and the
    plugin's real collector reads them back, on a private registry."""
    directory = str(tmp_path_factory.mktemp("moe_graphs_metrics"))
    MetricsRecorder(rank=0, directory=directory)
    registry = CollectorRegistry()
    registry.register(PluginCollector(directory))
    series: Exported = {}
    for family in registry.collect():
        for sample in family.samples:
            for label, value in sample.labels.items():
                series.setdefault(sample.name, {}).setdefault(label, set()).add(value)
    assert all(any(s.startswith(name) for s in series) for name in METRICS), sorted(series)
    return series


@pytest.fixture(scope="module")
def vllm_names() -> set[str]:
    """`"vllm:<name>"` literals in the installed vLLM's v1/metrics sources; `find_spec` locates
    the package without importing it (vLLM's imports are heavy)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    metrics_dir = pathlib.Path(spec.submodule_search_locations[0]) / "v1" / "metrics"
    sources = (f.read_text() for f in metrics_dir.glob("*.py"))
    names = {name for text in sources for name in re.findall(r'"(vllm:[\w:]+)"', text)}
    assert "vllm:num_requests_running" in names, metrics_dir  # the source layout moved
    return names


@pytest.fixture(scope="module")
def exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every target; fails unless the file is a dashboard of queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"] and dashboard["schemaVersion"] >= 36
    found = []
    for panel in dashboard["panels"]:
        assert panel["title"] and panel.get("description") and panel["targets"], panel.get("id")
        found += [(panel["title"], target["expr"]) for target in panel["targets"]]
    assert all(expr.strip() for _, expr in found)
    return found


def test_every_query_finds_real_series_and_labels(exprs, exported, vllm_names):
    found = [f"{title}: {p}" for title, expr in exprs for p in problems(expr, exported, vllm_names)]
    assert not found, "\n".join(found)
    assert any(name.startswith("vllm:") for _, expr in exprs for name in series_names(expr))


def test_every_plugin_metric_has_a_panel(exprs):
    """A metric added to metrics.METRICS must get a panel too."""
    used = {name for _, expr in exprs for name in series_names(expr)}
    assert not [m for m in METRICS if not any(u.startswith(m) for u in used)]


def test_extractor_reads_names_not_functions_or_labels():
    expr = ('histogram_quantile(0.99, sum by (le, kind) (rate(moe_graphs_capture_seconds_bucket'
            '{row="x"}[$__rate_interval]))) / on (kind) vllm:num_requests_running offset 5m')
    assert series_names(expr) == {"moe_graphs_capture_seconds_bucket", "vllm:num_requests_running"}
    assert grouping_labels(expr) == {"le", "kind"}


@pytest.mark.parametrize("expr, complaint", [
    ("rate(moe_graphs_made_up_total[5m])", "not exported by the plugin"),
    ("moe_graphs_capture_seconds", "not exported by the plugin"),  # histogram: _bucket/_sum/_count
    ("vllm:made_up_seconds_bucket", "not defined in the installed vLLM"),
    ("sum by (reason) (rate(moe_graphs_replays_total[5m]))", "no label 'reason'"),
    ('moe_graphs_graph_rows_total{row="pad"}', "never takes 'pad'"),
    ("up", "neither"),  # real in Prometheus, but not a series this dashboard may rely on
])
def test_checker_rejects_what_does_not_exist(expr, complaint, exported, vllm_names):
    assert any(complaint in p for p in problems(expr, exported, vllm_names))
