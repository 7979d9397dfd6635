"""The package's walls, checked on every module's AST: only `integration/` touches vLLM's
internals (a port to a newer vLLM changes only it); `cli/` uses vLLM's public API only; the
kernels, KV storage, graph runner, capability, config and metrics import no vLLM at all."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "vllm_moe_graphs"
INTEGRATION = "integration"  # the one place that may import vLLM internals
PUBLIC_API = {"vllm", "vllm.inputs"}  # what `cli/` may import: vLLM's documented entry points
PUBLIC_ONLY = {"cli"}


def vllm_imports(source: str) -> list[str]:
    """Modules of vLLM that `source` imports, at any depth (function-level imports too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [n for n in names if n == "vllm" or n.startswith("vllm.")]
    return found


def wall_violations(rel: pathlib.PurePath, source: str) -> list[str]:
    """What module `rel` (relative to the package) imports across a wall."""
    top = rel.parts[0] if len(rel.parts) > 1 else ""
    if top == INTEGRATION:
        return []
    allowed = PUBLIC_API if top in PUBLIC_ONLY else set()
    return [f"{rel}: imports {m}" for m in vllm_imports(source) if m not in allowed]


def test_only_integration_imports_vllm_internals():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30 and any(p.parts[-2] == INTEGRATION for p in modules)
    violations = [v for p in modules
                  for v in wall_violations(p.relative_to(PACKAGE), p.read_text())]
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("rel,source,bad", [
    ("ops/k.py", "import vllm.v1.attention.backend\n", True),
    ("graphs/r.py", "def f():\n    from vllm.config import VllmConfig\n", True),
    ("cli/d.py", "from vllm import LLM\nfrom vllm.inputs import TokensPrompt\n", False),
    ("cli/d.py", "from vllm.engine.arg_utils import EngineArgs\n", True),
    ("integration/w.py", "from vllm.v1.worker.gpu_worker import Worker\n", False),
    ("plugin.py", "import vllm_moe_graphs.envs\nfrom . import config\n", False),
])
def test_the_wall_check_sees_what_crosses(rel, source, bad):
    assert bool(wall_violations(pathlib.PurePath(rel), source)) is bad


PATCH_DIR = ("integration", "patch")  # the one place that rebinds other objects' attributes


def patch_violations(rel: pathlib.PurePath, source: str) -> list[str]:
    """`setattr` / `delattr` calls of module `rel` outside `integration/patch/`."""
    if rel.parts[:2] == PATCH_DIR:
        return []
    return [f"{rel}:{node.lineno}: {node.func.id}()" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")]


def test_only_integration_patch_rebinds_attributes():
    violations = [v for p in sorted(PACKAGE.rglob("*.py"))
                  for v in patch_violations(p.relative_to(PACKAGE), p.read_text())]
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("rel,source,bad", [
    ("integration/x.py", "setattr(module, 'f', g)\n", True),
    ("graphs/x.py", "def f(m):\n    delattr(m, 'forward')\n", True),
    ("integration/patch/x.py", "setattr(module, 'f', g)\n", False),
    ("integration/x.py", "getattr(module, 'f')\n", False),
])
def test_the_patch_check_sees_what_crosses(rel, source, bad):
    assert bool(patch_violations(pathlib.PurePath(rel), source)) is bad
