"""No import circle in the package, counting every import: at module level, under
`if TYPE_CHECKING:` and inside functions (tests/import_graph.py). A circle is broken the way
STYLE.md says: a start-up helper takes a protocol, not the runner class; a helper moves to the
module that owns it; a caller passes a callable."""

from __future__ import annotations

import textwrap

import pytest

from tests.import_graph import (
    FUNCTION,
    MODULE,
    TYPE_CHECKING,
    describe,
    find_cycle,
    import_graph,
    imports_of,
)


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "vllm_moe_graphs.integration.runner.lifecycle" in graph and len(graph) > 60
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {describe(cycle, graph)}"


@pytest.mark.parametrize("graph,cycle", [
    ({"a": ["b"], "b": ["c"], "c": ["a"]}, ["a", "b", "c", "a"]),
    ({"a": ["b"], "b": ["c"], "c": ["b"], "d": ["a"]}, ["b", "c", "b"]),
    ({"a": ["b", "c"], "b": ["c"], "c": []}, None),  # a diamond is no circle
    ({"a": [], "b": ["a"]}, None),
])
def test_find_cycle_reports_the_circle_path(graph, cycle):
    assert find_cycle(graph) == cycle


MODULES = {"p", "p.a", "p.b", "p.c", "p.sub", "p.sub.d"}


@pytest.mark.parametrize("source,expected", [
    ("import p.a\n", {"p.a": MODULE}),
    ("from p import a, CONSTANT\n", {"p.a": MODULE, "p": MODULE}),
    ("from p.sub.d import f\n", {"p.sub.d": MODULE}),
    ("import numpy, vllm.config\n", {}),  # not the package's
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import A\n",
     {"p.a": TYPE_CHECKING}),
    ("import typing\nif typing.TYPE_CHECKING:\n    import p.a\nelse:\n    import p.c\n",
     {"p.a": TYPE_CHECKING, "p.c": MODULE}),
    ("def f():\n    from p.a import g\n", {"p.a": FUNCTION}),
    ("class C:\n    def m(self):\n        import p.a\n", {"p.a": FUNCTION}),
    ("def f():\n    import p.a\nimport p.a\n", {"p.a": MODULE}),  # the strongest counts
    ("from . import c\nfrom .sub import d\n", {"p.c": MODULE, "p.sub.d": MODULE}),
])
def test_imports_of_sees_every_level(source, expected):
    assert imports_of(source, "p.b", MODULES) == expected


def test_a_circle_through_type_checking_and_a_function_import_is_found(tmp_path):
    """The circle this package had: lifecycle imports precapture inside a method, precapture
    imports lifecycle for its annotations only; neither import runs at module import, both
    join the modules."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "lifecycle.py").write_text(textwrap.dedent("""
        class GraphLifecycle:
            def capture_model(self):
                from pkg.precapture import precapture_all
                return precapture_all(self)
    """))
    (pkg / "precapture.py").write_text(textwrap.dedent("""
        from __future__ import annotations
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg.lifecycle import GraphLifecycle

        def precapture_all(lifecycle: GraphLifecycle) -> int:
            return 0
    """))
    graph = import_graph(pkg)
    cycle = find_cycle(graph)
    assert cycle == ["pkg.lifecycle", "pkg.precapture", "pkg.lifecycle"]
    assert describe(cycle, graph) == (
        "pkg.lifecycle -[function]-> pkg.precapture -[type_checking]-> pkg.lifecycle")
    (pkg / "precapture.py").write_text("def precapture_all(lifecycle) -> int:\n    return 0\n")
    assert find_cycle(import_graph(pkg)) is None  # the protocol's way: no import back
