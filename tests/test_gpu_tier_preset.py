"""`benchmarks/gpu/tests.sh tier` and `fp8` run every GPU test between them: a new test must not
fall out of both."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "benchmarks" / "gpu" / "tests.sh").read_text()
# the engine tests, each named in a lane by its node id (`"$VAR::test_name"`)
ENGINE_TESTS = [ROOT / "tests" / "graphs" / f"test_gpu_{name}.py"
                for name in ("parity", "faults", "serve")]


def _preset() -> str:
    """The tier's and the FP8 preset's lanes, one text."""
    blocks = []
    for name in ("tier", "fp8"):
        start = SCRIPT.index(f'if [ "${{1:-}}" = {name} ]; then')
        blocks.append(SCRIPT[start:SCRIPT.index("\nfi\n", start)])
    return "\n".join(blocks)


def _file_variables(preset: str) -> dict[str, str]:
    """The preset's shell variables that name a test file: path -> `$VAR`."""
    return {path: f"${var}" for var, path in re.findall(r"\b([A-Z]+)=(tests/\S+\.py)\b", preset)}


def test_every_engine_test_is_in_a_lane():
    preset = _preset()
    variables = _file_variables(preset)
    missing, count = [], 0
    for path in ENGINE_TESTS:
        rel = str(path.relative_to(ROOT))
        assert rel in variables, f"the tier preset in benchmarks/gpu/tests.sh names no {rel}"
        names = [n.name for n in ast.parse(path.read_text()).body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        count += len(names)
        missing += [f"{rel}::{n}" for n in names if f"{variables[rel]}::{n}" not in preset]
    assert count >= 9
    assert not missing, f"add to the tier preset in benchmarks/gpu/tests.sh: {missing}"


def test_every_other_gpu_test_file_is_under_a_lane_path():
    preset = _preset()
    lane_paths = [tok for tok in preset.split() if tok.startswith("tests/") and "::" not in tok]
    gpu_files = [p for p in (ROOT / "tests").rglob("test_*.py")
                 if p not in (*ENGINE_TESTS, pathlib.Path(__file__).resolve())
                 and "mark.gpu" in p.read_text()]
    assert gpu_files
    outside = [str(p.relative_to(ROOT)) for p in gpu_files
               if not any(str(p.relative_to(ROOT)).startswith(lp) for lp in lane_paths)]
    assert not outside, f"GPU tests outside every lane of the tier preset: {outside}"
