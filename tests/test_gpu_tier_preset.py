"""`benchmarks/gpu/tests.sh tier` runs every GPU test: a new test must not fall out of it."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "benchmarks" / "gpu" / "tests.sh").read_text()
ENGINE_TESTS = ROOT / "tests" / "graphs" / "test_gpu_integration.py"


def _preset() -> str:
    start = SCRIPT.index('if [ "${1:-}" = tier ]; then')
    return SCRIPT[start:SCRIPT.index("\nfi\n", start)]


def test_every_engine_test_is_in_a_lane():
    names = [n.name for n in ast.parse(ENGINE_TESTS.read_text()).body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    assert len(names) >= 9
    missing = [n for n in names if f"::{n}" not in _preset()]
    assert not missing, f"add to the tier preset in benchmarks/gpu/tests.sh: {missing}"


def test_every_other_gpu_test_file_is_under_a_lane_path():
    preset = _preset()
    lane_paths = [tok for tok in preset.split() if tok.startswith("tests/") and "::" not in tok]
    gpu_files = [p for p in (ROOT / "tests").rglob("test_*.py")
                 if p not in (ENGINE_TESTS, pathlib.Path(__file__).resolve())
                 and "mark.gpu" in p.read_text()]
    assert gpu_files
    outside = [str(p.relative_to(ROOT)) for p in gpu_files
               if not any(str(p.relative_to(ROOT)).startswith(lp) for lp in lane_paths)]
    assert not outside, f"GPU tests outside every lane of the tier preset: {outside}"
