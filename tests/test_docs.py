"""The docs point at what exists: every relative link of README.md and docs/*.md reaches a file
and, with an anchor, one of its headings; `docs/benchmarking.md`'s result-file index names
every file in `benchmarks/results/` and no file that is not there; every metric and every
plugin config key is documented (README and docs/operating.md, docs/configuration.md)."""

from __future__ import annotations

import dataclasses
import fnmatch
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
INDEX_DOC = ROOT / "docs" / "benchmarking.md"
INDEX_HEADING = "# Result files"

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`]+)`")


def prose_lines(text: str) -> list[str]:
    """`text`'s lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation but `-` and `_` dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text; a repeated heading gets `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_and_anchors_follow_github():
    text = ("# Results on the H200 (vLLM 0.26.0)\n```\n# not a heading\n```\n"
            "## Results on the H200\n## Results on the H200\n### Where a step's time goes\n")
    assert anchors(text) == {"results-on-the-h200-vllm-0260", "results-on-the-h200",
                             "results-on-the-h200-1", "where-a-steps-time-goes"}


def broken_links(doc: pathlib.Path) -> list[str]:
    """Relative links of `doc` whose file or heading anchor does not exist."""
    broken = []
    for line in prose_lines(doc.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
            elif anchor and anchor not in anchors(dest.read_text()):
                broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(doc):
    assert broken_links(doc) == []


def index_patterns() -> list[str]:
    """The file names and globs in the first column of the result-file index table."""
    text = INDEX_DOC.read_text()
    assert INDEX_HEADING in text, f"{INDEX_DOC.name} lost its {INDEX_HEADING!r} section"
    section = text.split(INDEX_HEADING, 1)[1]
    patterns = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 3 or set(cells[1].strip()) <= set("-"):
            continue
        patterns += [p for p in CODE.findall(cells[1]) if p != "files"]
    return patterns


def expand(pattern: str) -> list[str]:
    """`a.{json,png}` -> `a.json`, `a.png`; other patterns as they are."""
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    return [pattern[:m.start()] + alt + pattern[m.end():] for alt in m.group(1).split(",")]


def test_result_index_names_every_result_file_and_only_those():
    files = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())
    patterns = [g for p in index_patterns() for g in expand(p)]
    assert patterns, "the result-file index table has no rows"
    unlisted = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in patterns)]
    matching_nothing = [g for g in patterns if not fnmatch.filter(files, g)]
    assert unlisted == [], f"result files the index in {INDEX_DOC.name} does not name"
    assert matching_nothing == [], f"index entries in {INDEX_DOC.name} that match no file"


@pytest.mark.parametrize("doc", ["README.md", "docs/operating.md"])
def test_every_metric_is_documented(doc):
    from vllm_moe_graphs.metrics import METRICS

    text = (ROOT / doc).read_text()
    assert [name for name in METRICS if f"`{name}" not in text] == []


def test_every_config_key_is_in_the_configuration_table():
    from vllm_moe_graphs.config import PluginConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| `")]
    keys = [f.name for f in dataclasses.fields(PluginConfig)]
    assert [k for k in keys if not any(ln.startswith(f"| `{k}` |") for ln in rows)] == []
    # and nothing else: a key the table names must exist
    named = [ln.split("`")[1] for ln in rows]
    assert [k for k in named if k not in keys] == []
