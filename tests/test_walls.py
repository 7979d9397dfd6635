"""The package's walls, checked on every module's AST: only `integration/` touches vLLM's
internals (a port to a newer vLLM changes only it); `cli/` uses vLLM's public API only; the
kernels, KV storage, graph runner, capability, config and metrics import no vLLM at all; only
`integration/patch/` rebinds attributes. Inside integration/, each room imports only the rooms
its `__init__` names, nothing on the step path imports `startup/`, and an `__init__` imports
nothing; no module of the package, of benchmarks/ or of tests/ passes 400 lines, no room of
integration/ 1,500 (STYLE.md habits 1, 14).
No import circle: tests/test_import_cycles.py."""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.import_graph import import_graph, reaches

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "vllm_moe_graphs"
BENCHMARKS = PACKAGE.parent / "benchmarks"  # not the package, but held to its module size
TESTS = PACKAGE.parent / "tests"  # the same
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
    ("integration/runner/lifecycle.py", "def f():\n    from vllm.config import X\n", False),
    ("integration/model/registry.py", "from vllm.model_executor.models import qwen3\n", False),
    ("kv/storage.py", "def f():\n    import vllm.envs\n", True),
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
    ("integration/runner/lifecycle.py", "def f(r):\n    setattr(r, 'model', m)\n", True),
    ("integration/model/moe_padding.py", "setattr(router, 'select_experts', f)\n", True),
    ("integration/x.py", "getattr(module, 'f')\n", False),
])
def test_the_patch_check_sees_what_crosses(rel, source, bad):
    assert bool(patch_violations(pathlib.PurePath(rel), source)) is bad


# -- rooms of integration/ (STYLE.md habit 14; the map: vllm_moe_graphs/integration/__init__.py)
ROOT = "vllm_moe_graphs"
INTEGRATION_PKG = f"{ROOT}.{INTEGRATION}"
GLUE = {"hooks", "config_facts", "signatures"}  # engine-config glue at the root of integration/
ROOMS = {"runner", "startup", "model", "attention", "patch"}
ROOM_MAY_IMPORT = {  # room -> the other rooms of integration/ it may import, at any level
    "worker": {"runner", "startup", "patch", "glue"},
    "glue": set(),
    "runner": {"model", "attention", "startup", "patch", "glue"},
    "startup": {"model", "patch", "glue"},  # the runner only through its protocols
    "model": {"patch"},
    "attention": set(),
    "patch": {"glue"},
}
STARTUP = f"{INTEGRATION_PKG}.startup"
STEP_PATH = (  # what a serving step runs: never imports start-up work
    f"{INTEGRATION_PKG}.runner.decode_inputs", f"{INTEGRATION_PKG}.runner.buffers",
    f"{INTEGRATION_PKG}.runner.graph_sampling",
    f"{INTEGRATION_PKG}.model", f"{INTEGRATION_PKG}.attention",
    f"{ROOT}.graphs", f"{ROOT}.ops", f"{ROOT}.kv",
)
MAX_MODULE_LINES = 400  # STYLE.md habit 1
MAX_ROOM_LINES = 1500  # STYLE.md habit 14: past it, a room splits by concern


def room_of(module: str) -> str | None:
    """The room of integration/ that `module` lives in (None outside integration/; `?` for a
    module at its root that is neither the worker nor glue)."""
    if module == INTEGRATION_PKG:
        return "glue"  # the room map: a docstring
    if not module.startswith(INTEGRATION_PKG + "."):
        return None
    first = module.split(".")[2]
    if first in ROOMS:
        return first
    return "worker" if first == "worker" else "glue" if first in GLUE else "?"


def room_violations(graph: dict[str, dict[str, str]]) -> list[str]:
    """Imports between rooms of integration/ that `ROOM_MAY_IMPORT` does not allow."""
    out = []
    for module, imports in sorted(graph.items()):
        room = room_of(module)
        if room == "?":
            out.append(f"{module}: in no room of integration/ (ROOMS, GLUE)")
        if room is None or room == "?":
            continue
        for target, where in sorted(imports.items()):
            other = room_of(target)
            if other not in (None, room) and other not in ROOM_MAY_IMPORT[room]:
                out.append(f"{module} ({room}/) imports {target} ({other}/) [{where}]")
    return out


def step_path_violations(graph: dict[str, dict[str, str]]) -> list[str]:
    """Step-path modules that reach `integration/startup/` through imports at any level and any
    depth, with the path."""
    out = []
    for module in sorted(graph):
        if any(module == p or module.startswith(p + ".") for p in STEP_PATH):
            if path := reaches(graph, module, STARTUP):
                out.append(" -> ".join(path))
    return out


def test_rooms_import_only_what_their_init_says():
    graph = import_graph()
    assert {room_of(m) for m in graph} >= set(ROOM_MAY_IMPORT)
    violations = room_violations(graph)
    assert not violations, "\n".join(violations)


def test_nothing_on_the_step_path_imports_startup():
    graph = import_graph()
    assert sum(any(m.startswith(p) for p in STEP_PATH) for m in graph) > 25
    violations = step_path_violations(graph)
    assert not violations, "\n".join(violations)


_I = INTEGRATION_PKG


@pytest.mark.parametrize("graph,bad", [
    ({f"{_I}.runner.lifecycle": {f"{_I}.startup.precapture": "function"}}, []),
    ({f"{_I}.startup.precapture": {f"{_I}.runner.lifecycle": "type_checking"}},
     [f"{_I}.startup.precapture (startup/) imports {_I}.runner.lifecycle (runner/) "
      "[type_checking]"]),
    ({f"{_I}.model.moe_padding": {f"{_I}.attention.metadata": "function"}},
     [f"{_I}.model.moe_padding (model/) imports {_I}.attention.metadata (attention/) "
      "[function]"]),
    ({f"{_I}.patch.x": {f"{_I}.hooks": "function", f"{ROOT}.config": "module"}}, []),
    ({f"{_I}.helpers": {}}, [f"{_I}.helpers: in no room of integration/ (ROOMS, GLUE)"]),
])
def test_the_room_check_sees_what_crosses(graph, bad):
    assert room_violations(graph) == bad


@pytest.mark.parametrize("graph,bad", [
    ({f"{ROOT}.ops.k": {f"{_I}.model.m": "function"},
      f"{_I}.model.m": {f"{_I}.startup.moe_warm_up": "type_checking"}},
     [f"{_I}.model.m -> {_I}.startup.moe_warm_up",
      f"{ROOT}.ops.k -> {_I}.model.m -> {_I}.startup.moe_warm_up"]),
    ({f"{_I}.runner.buffers": {f"{_I}.startup": "function"}},
     [f"{_I}.runner.buffers -> {_I}.startup"]),
    ({f"{_I}.runner.lifecycle": {f"{_I}.startup.precapture": "function"}}, []),  # off the path
])
def test_the_step_path_check_sees_what_crosses(graph, bad):
    assert step_path_violations(graph) == bad


def test_integration_inits_import_nothing():
    """An `__init__` of integration/ says what lives there; importing it loads nothing (so
    `register()` stays cheap and no package edge hides an import circle)."""
    inits = sorted((PACKAGE / INTEGRATION).rglob("__init__.py"))
    assert len(inits) == 1 + len(ROOMS)
    found = [f"{p.relative_to(PACKAGE)}:{n.lineno}" for p in inits
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Import | ast.ImportFrom)
             and getattr(n, "module", None) != "__future__"]
    assert not found, found


def size_violations(lines: dict[pathlib.PurePath, int]) -> list[str]:
    """Modules (paths relative to the package, or to the checkout for benchmarks/ and tests/ ->
    line counts) over `MAX_MODULE_LINES`, rooms of integration/ (a folder, or its root's own
    files) over `MAX_ROOM_LINES`."""
    out = [f"{rel}: {n} lines > {MAX_MODULE_LINES}" for rel, n in sorted(lines.items())
           if n > MAX_MODULE_LINES]
    rooms: dict[str, int] = {}
    for rel, n in lines.items():
        if rel.parts[0] == INTEGRATION:
            room = rel.parts[1] if len(rel.parts) > 2 else "(root)"
            rooms[room] = rooms.get(room, 0) + n
    return out + [f"integration/{room}: {n} lines > {MAX_ROOM_LINES}"
                  for room, n in sorted(rooms.items()) if n > MAX_ROOM_LINES]


def test_no_module_or_room_is_too_large():
    lines = {p.relative_to(PACKAGE): len(p.read_text().splitlines())
             for p in sorted(PACKAGE.rglob("*.py"))}
    violations = size_violations(lines)
    assert not violations, "\n".join(violations)


def test_no_benchmark_module_is_too_large():
    modules = sorted(BENCHMARKS.rglob("*.py"))
    assert len(modules) > 30 and any(p.parts[-2] == "kernels" for p in modules)
    lines = {p.relative_to(BENCHMARKS.parent): len(p.read_text().splitlines()) for p in modules}
    violations = size_violations(lines)
    assert not violations, "\n".join(violations)


def test_no_test_module_is_too_large():
    modules = sorted(TESTS.rglob("*.py"))
    assert len(modules) > 60 and any(p.parts[-2] == "runner" for p in modules)
    lines = {p.relative_to(TESTS.parent): len(p.read_text().splitlines()) for p in modules}
    violations = size_violations(lines)
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("lines,bad", [
    ({"graphs/runner.py": 400, "integration/runner/lifecycle.py": 400}, []),
    ({"integration/runner/lifecycle.py": 408},
     ["integration/runner/lifecycle.py: 408 lines > 400"]),
    ({f"integration/startup/m{i}.py": 300 for i in range(6)},
     ["integration/startup: 1800 lines > 1500"]),
    ({f"integration/m{i}.py": 300 for i in range(6)}, ["integration/(root): 1800 lines > 1500"]),
    ({"benchmarks/serving/bench.py": 514, "benchmarks/harness/sweep.py": 400},
     ["benchmarks/serving/bench.py: 514 lines > 400"]),
    ({f"benchmarks/kernels/m{i}.py": 300 for i in range(6)}, []),  # no room limit there
    ({"tests/integration/runner/test_override_points.py": 1106, "tests/kv/test_storage.py": 253},
     ["tests/integration/runner/test_override_points.py: 1106 lines > 400"]),
    ({f"tests/integration/runner/m{i}.py": 300 for i in range(6)}, []),  # nor there
])
def test_the_size_check_sees_what_is_too_large(lines, bad):
    assert size_violations({pathlib.PurePath(k): v for k, v in lines.items()}) == bad
