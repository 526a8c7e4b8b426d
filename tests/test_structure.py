"""The shape of the code: imports flow one way, axis names are defined once, files stay small,
no capability probing. Each checker first proves on a planted example that it finds what it
looks for."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from jaxpar.parallel.context.plan import ContextPlan
from jaxpar.parallel.pipeline.options import PipelineOptions
from jaxpar.parallel.plan import ParallelPlan
from jaxpar.parallel.tensor import TensorPlan
from jaxpar.parallel.zero import ZeroPlan

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


def package_of(module: str, depth: int = 2) -> str:
    """The node of the package graph a module belongs to: `jaxpar.<package>` for a module inside a
    package (`jaxpar.models.llama.hf` -> `jaxpar.models`), the module itself at the top level.
    `depth=3` names subpackages (`jaxpar.analysis.cost.memory` -> `jaxpar.analysis.cost`)."""
    parts = module.split(".")
    return ".".join(parts[:depth])


def package_graph(module_graph: dict, depth: int = 2) -> dict:
    graph: dict = {}
    for module, imported in module_graph.items():
        node = package_of(module, depth)
        graph.setdefault(node, set()).update(package_of(m, depth) for m in imported if package_of(m, depth) != node)
    return graph


def test_package_graph_reader_finds_a_planted_cycle():
    # Modules are acyclic, their packages are not: models.a -> parallel.b -> models.c.
    modules_only = {
        "jaxpar.models.a": {"jaxpar.parallel.b"},
        "jaxpar.parallel.b": {"jaxpar.models.c"},
        "jaxpar.models.c": set(),
    }
    assert find_cycle(modules_only) is None
    assert find_cycle(package_graph(modules_only)) == ["jaxpar.models", "jaxpar.parallel", "jaxpar.models"]


def test_jaxpar_package_graph_is_acyclic():
    """Packages (`jaxpar.models`, `jaxpar.parallel`, `jaxpar.kernels`, `jaxpar.interop`,
    `jaxpar.train`, ...) and top-level modules as nodes: imports flow one way between them too."""
    known = modules()
    graph = package_graph({name: imports_of(path.read_text(), set(known)) - {name} for name, path in known.items()})
    assert {"jaxpar.models", "jaxpar.parallel", "jaxpar.kernels", "jaxpar.interop", "jaxpar.train"} <= set(graph)
    assert sum(len(v) for v in graph.values()) > 20, "the reader found too few package imports to be trusted"
    assert find_cycle(graph) is None, f"package import cycle: {' -> '.join(find_cycle(graph))}"


# The analysis wing's rooms, lowest first: each may import only the rooms before it.
ANALYSIS_ROOMS = ("program", "cost", "planner", "reports")


def room_violations(module_graph: dict, rooms=ANALYSIS_ROOMS, parent="jaxpar.analysis") -> set:
    """(importer room, imported room) pairs where a room imports one after it, or a room module
    imports the package root's modules directly (every analysis module lives in a room)."""
    order = {f"{parent}.{room}": i for i, room in enumerate(rooms)}
    graph = package_graph({m: deps for m, deps in module_graph.items() if m.startswith(parent + ".")}, depth=3)
    found = set()
    for node, imported in graph.items():
        for dep in imported:
            if not dep.startswith(parent + "."):
                continue
            if node not in order or dep not in order or order[dep] > order[node]:
                found.add((node, dep))
    return found


def test_room_checker_finds_an_upward_import():
    planted = {
        "jaxpar.analysis.program.hlo": {"jaxpar.analysis.cost.memory"},  # the reader reaching for the model
        "jaxpar.analysis.cost.memory": {"jaxpar.analysis.program.hlo"},
        "jaxpar.analysis.reports.sweep": {"jaxpar.analysis.planner.search"},
    }
    assert room_violations(planted) == {("jaxpar.analysis.program", "jaxpar.analysis.cost")}
    assert find_cycle(package_graph(planted, depth=3)) is not None
    stray = {"jaxpar.analysis.loose": {"jaxpar.analysis.cost.memory"}}  # a module outside every room
    assert room_violations(stray) == {("jaxpar.analysis.loose", "jaxpar.analysis.cost")}


def test_analysis_rooms_import_one_way():
    """program <- cost <- planner <- reports: the program reader never needs the model, the model
    never the planner, the planner never a report."""
    known = modules()
    graph = {name: imports_of(path.read_text(), set(known)) - {name} for name, path in known.items()}
    rooms = {package_of(m, 3) for m in graph if m.startswith("jaxpar.analysis.")}
    assert rooms == {f"jaxpar.analysis.{r}" for r in ANALYSIS_ROOMS}, rooms
    edges = package_graph({m: d for m, d in graph.items() if m.startswith("jaxpar.analysis.")}, depth=3)
    assert sum(len(v) for v in edges.values()) >= 5, "the reader found too few room imports to be trusted"
    assert not room_violations(graph)
    assert find_cycle(edges) is None


def is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def imported_test_modules(source: str) -> set:
    """Test modules (`tests....test_*`) a source imports: in its code, anywhere (function-level
    imports too), relatively, or in a worker's source it holds as a string."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if is_test_module(a.name))
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names = [f"{module}.{a.name}" if node.module else module + a.name for a in node.names]
            if node.level:  # relative: inside tests/, any module called test_* is a test module
                found.update(n for n in [module] + names if n.rsplit(".", 1)[-1].startswith("test_"))
            else:
                found.update(n for n in [module] + names if is_test_module(n))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                found |= imported_test_modules(node.value)
            except SyntaxError:
                pass  # prose, not a program
    return found


def test_test_import_checker_finds_planted_imports():
    # Each planted import is split in two strings, so this file's own constants hold none of them.
    planted = [
        "from tests.train." + "test_workdir import hold_lock",
        "from tests.interop import " + "test_hf_llama",
        "def f():\n    import tests.distributed." + "test_multiprocess",
        "from ." + "test_pipeline import pp",
        'WORKER = """\nfrom tests.models.' + 'test_init_independence import LAYOUTS\n"""',
    ]
    assert [len(imported_test_modules(source)) for source in planted] == [1, 1, 1, 1, 1]
    assert imported_test_modules("from tests.support.tiny import llama\nfrom tests import conftest") == set()


def test_no_test_module_imports_another():
    """Helpers live in tests/support: a test file imports no other test file (which would run its
    module-level code, collect its tests twice under another name, and tie the two together)."""
    found = {str(p.relative_to(ROOT)): imported_test_modules(p.read_text()) for p in sorted((ROOT / "tests").rglob("*.py"))}
    assert len(found) > 50, "the checker found too few test files to be trusted"
    assert not {k: v for k, v in found.items() if v}


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


# ---- the cost model prices the plan that runs ----

# How the analysis names each part of the plan when it reads it (`layout.plan.zero.shard_params`).
PLAN_OWNERS = {
    ParallelPlan: ("plan",),
    ZeroPlan: ("zero",),
    TensorPlan: ("tensor",),
    PipelineOptions: ("pipeline", "pipe"),
    ContextPlan: ("context",),
}
# Plan fields the analysis need not read itself, each with the reason.
NOT_READ_DIRECTLY = {
    (PipelineOptions, "facts"): "input of the auto split; the analysis reads `stage_layers`",
    (PipelineOptions, "seq_len"): "input of the auto split; the analysis reads `stage_layers`",
    (PipelineOptions, "split"): "the requested split; the analysis reads `stage_layers`",
    (PipelineOptions, "given_table"): "a table given by hand; the analysis reads `table`",
    (PipelineOptions, "layers"): "input of `shard_layers`, which the rules table reads",
    (PipelineOptions, "num_ranks"): "mesh.pipeline, read from `mesh_shape`",
    (TensorPlan, "size"): "mesh.tensor, read from `mesh_shape`",
    (ContextPlan, "size"): "mesh.context, read from `mesh_shape`",
}
# Where the cost model reads the plan: the analysis, and the rules table it shards parameters with.
PRICING_SOURCES = sorted((PACKAGE / "analysis" / "cost").glob("*.py")) + [PACKAGE / "sharding.py"]


def attribute_reads(source: str, owners: tuple) -> set:
    """Names read as `<owner>.<name>`, the owner a variable or attribute called one of `owners`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            value = node.value
            owner = value.attr if isinstance(value, ast.Attribute) else value.id if isinstance(value, ast.Name) else None
            if owner in owners:
                found.add(node.attr)
    return found


def unread_fields(cls, owners: tuple, sources: list[str]) -> set:
    read = set().union(*(attribute_reads(s, owners) for s in sources))
    return {f.name for f in dataclasses.fields(cls) if f.name not in read and (cls, f.name) not in NOT_READ_DIRECTLY}


def test_unread_plan_field_finder_sees_a_field_nobody_reads():
    @dataclasses.dataclass(frozen=True)
    class Planned:
        priced: int = 0
        forgotten: int = 0

    assert unread_fields(Planned, ("plan",), ["cost = layout.plan.priced * 2"]) == {"forgotten"}
    assert unread_fields(Planned, ("plan",), ["cost = layout.forgotten + plan.priced"]) == {"forgotten"}


def test_every_plan_decision_is_read_by_the_cost_model():
    """A decision added to `ParallelPlan` (or one of its parts) must be priced: read by
    jaxpar/analysis (or the rules table it applies), not re-derived from the config there."""
    hints = typing.get_type_hints(ParallelPlan)
    parts = {arg for hint in hints.values() for arg in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(arg)}
    assert parts <= set(PLAN_OWNERS), f"a plan part without an owner name here: {parts - set(PLAN_OWNERS)}"
    sources = [p.read_text() for p in PRICING_SOURCES]
    unread = {cls.__name__: unread_fields(cls, owners, sources) for cls, owners in PLAN_OWNERS.items()}
    assert not {k: v for k, v in unread.items() if v}
