"""The package's import graph, read from each module's AST (nothing is imported): which of its
modules every module imports, and where the import stands: at module level, under
`if TYPE_CHECKING:`, or inside a function (a lazy import still joins the two modules).

An import names one module: `from p import m` the submodule `p.m` where there is one, else the
package `p`; `import p.q.r` the longest prefix that is a module of the package. The packages
above it, which Python imports first, are not counted: an `__init__` of integration/ imports
nothing (tests/test_walls.py), so they add no edge there."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable, Mapping

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "vllm_moe_graphs"
MODULE, TYPE_CHECKING, FUNCTION = "module", "type_checking", "function"
_RANK = {MODULE: 0, TYPE_CHECKING: 1, FUNCTION: 2}

Graph = dict[str, dict[str, str]]  # module -> {imported module: where (the first seen)}


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    """`root/integration/runner/lifecycle.py` -> `<root>.integration.runner.lifecycle`."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _named(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> list[str]:
    """The dotted names `node` imports (relative imports resolved against module `name`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def imports_of(source: str, name: str, modules: set[str],
               is_package: bool = False) -> dict[str, str]:
    """The modules of `modules` that module `name` imports -> where (MODULE, TYPE_CHECKING or
    FUNCTION; of several imports of one module, the first in that order)."""
    found: dict[str, str] = {}

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                here = FUNCTION
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and where != FUNCTION:
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), TYPE_CHECKING)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), where)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = _named(child, name, is_package)
                if isinstance(child, ast.ImportFrom):  # `from p import m`: p.m if a module, else p
                    *members, base = names
                    names = [m if m in modules else base for m in members]
                for target in filter(None, map(resolve, names)):
                    if target != name and _RANK[here] < _RANK.get(found.get(target), 3):
                        found[target] = here
            visit(child, here)

    visit(ast.parse(source), MODULE)
    return found


def import_graph(root: pathlib.Path = PACKAGE) -> Graph:
    """Every module under `root` (a package folder) -> the modules of it that it imports."""
    paths = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    return {name: imports_of(p.read_text(), name, modules, p.name == "__init__.py")
            for name, p in paths.items()}


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import circle of `graph` as a path `[a, b, ..., a]`, or None when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def describe(cycle: list[str], graph: Graph) -> str:
    """`a -[module]-> b -[function]-> a`: the circle with where each import stands."""
    out = cycle[0]
    for a, b in zip(cycle, cycle[1:]):
        out += f" -[{graph[a][b]}]-> {b}"
    return out


def reaches(graph: Mapping[str, Iterable[str]], start: str,
            forbidden: str) -> list[str] | None:
    """An import path from `start` to a module in package `forbidden` (at any depth), or None."""
    seen, queue = {start: [start]}, [start]
    while queue:
        here = queue.pop(0)
        for nxt in sorted(graph.get(here, ())):
            if nxt in seen:
                continue
            seen[nxt] = seen[here] + [nxt]
            if nxt == forbidden or nxt.startswith(forbidden + "."):
                return seen[nxt]
            queue.append(nxt)
    return None
