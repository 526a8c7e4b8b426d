"""The shape of the code: imports flow one way, axis names are defined once, files stay small,
no capability probing. Each checker first proves on a planted example that it finds what it
looks for."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpar"
AXIS_NAMES = {"data", "pipeline", "context", "expert", "tensor"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(source: str, known: set) -> set:
    """jaxpar modules a source imports anywhere (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif node.module in known:
                    found.add(node.module)
    return found


def find_cycle(graph: dict) -> list | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_planted_cycle():
    known = {"jaxpar.a", "jaxpar.b", "jaxpar.c"}
    graph = {
        "jaxpar.a": imports_of("from jaxpar import b", known),
        "jaxpar.b": imports_of("def f():\n    import jaxpar.c", known),  # a late import counts
        "jaxpar.c": imports_of("from jaxpar.a import thing", known),
    }
    assert find_cycle(graph) == ["jaxpar.a", "jaxpar.b", "jaxpar.c", "jaxpar.a"]


def test_jaxpar_import_graph_is_acyclic():
    known = modules()
    graph = {name: imports_of(path.read_text(), set(known)) - {name} for name, path in known.items()}
    assert sum(len(v) for v in graph.values()) > 50, "the reader found too few imports to be trusted"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def axis_literals(source: str) -> list:
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and n.value in AXIS_NAMES]


def test_mesh_axis_names_are_spelled_only_in_axes_py():
    assert axis_literals('mesh.shape["tensor"]') == [1]  # the checker sees a literal
    found = {
        str(p.relative_to(ROOT)): axis_literals(p.read_text()) for p in PACKAGE.rglob("*.py") if p.name != "axes.py"
    }
    assert not {k: v for k, v in found.items() if v}


def test_no_capability_probing_with_hasattr():
    def probes(source):
        return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and n.id == "hasattr"]

    assert probes("hasattr(cls, 'aux_losses')") == [1]
    found = {str(p.relative_to(ROOT)): probes(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}


@pytest.mark.parametrize("folder", ["jaxpar", "scripts", "tests"])
def test_files_stay_small(folder):
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / folder).rglob("*.py")}
    assert sizes, folder
    assert not {k: n for k, n in sizes.items() if n > 500}


def test_each_parallelism_module_says_what_it_shards_and_which_test_proves_it():
    homes = ["parallel/data.py", "parallel/zero.py", "parallel/tensor.py", "parallel/expert.py", "parallel/pipeline/engine.py",
             "parallel/context/__init__.py"]
    for home in homes:
        doc = ast.get_docstring(ast.parse((PACKAGE / home).read_text())) or ""
        assert "shard" in doc.lower() and "collective" in doc.lower(), home
        named = {word.strip("`.,;:()") for word in doc.split() if word.strip("`.,;:()").startswith("tests/")}
        tests = {name.split("::")[0] for name in named}
        assert tests and all((ROOT / t).is_file() for t in tests), (home, tests)
