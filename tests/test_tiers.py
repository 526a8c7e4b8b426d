"""The tiers: the contributor's loop (`pytest -m "not slow and not multiprocess"`) keeps a test of
every tests/ folder and imports every jaxpar package; GPU tests are selected by the platform present.

The fast tier is what `-m FAST` keeps: read from this run's own collection, taken before `-m` and
`-k` deselect (`tests/conftest.py`), when it collected every test file (the whole suite or the fast
tier: pytest's `-m` keeps the items without those markers, module and class marks included), else
collected by pytest in a child process as a contributor runs it (this file alone); each checker
first finds what it looks for in a planted tree.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest
from tests.support import platforms
from tests.support.paths import REPO

FAST = "not slow and not multiprocess"


def fast_tests(root: Path) -> list[str]:
    """The node ids `pytest --collect-only -m FAST tests` lists when run in `root`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", FAST, "tests"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line.strip() for line in done.stdout.splitlines() if "::" in line]


def fast_tests_of_this_session(items, root: Path) -> list[str] | None:
    """The fast tier's node ids from this run's collection `items`, before deselection (what `-m FAST`
    keeps of it: no `slow` or `multiprocess` marker), when this run collected every test file; else
    None. The whole suite and the fast tier collect them all, so they need no second collection
    (14 s on 2 cores)."""
    collected = {Path(str(item.path)).relative_to(root).as_posix() for item in items}
    if collected != {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")}:
        return None
    return [item.nodeid for item in items if not item.get_closest_marker("slow") and not item.get_closest_marker("multiprocess")]


def folders_with_tests(root: Path) -> set[str]:
    """Folders under `root`/tests that hold test files (tests/support holds helpers only)."""
    return {p.parent.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")} - {"tests", "tests/support"}


def folders_without_fast_tests(root: Path, fast: list[str]) -> set[str]:
    return folders_with_tests(root) - {Path(node.split("::")[0]).parent.as_posix() for node in fast}


def packages_not_imported(package: Path, sources: list[str]) -> set[str]:
    """Packages under `package` (itself and every subpackage) that none of `sources` imports from."""
    names = {".".join(p.parent.relative_to(package.parent).parts) for p in package.rglob("__init__.py")}
    imported = set()
    for node in (n for source in sources for n in ast.walk(ast.parse(source))):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    return {name for name in names if not any(m == name or m.startswith(name + ".") for m in imported)}


PLANTED = {
    "pytest.ini": "[pytest]\naddopts = --strict-markers\nmarkers =\n    slow: s\n    multiprocess: m\n",
    "tests/alpha/test_alpha.py": "def test_fast():\n    pass\n",
    "tests/beta/test_beta.py": "import pytest\n\npytestmark = pytest.mark.slow\n\n\ndef test_heavy():\n    pass\n",
    "tests/gamma/test_gamma.py": (
        "import pytest\n\n\n@pytest.mark.multiprocess\ndef test_processes():\n    pass\n\n\n"
        "@pytest.mark.parametrize('n', [pytest.param(1, marks=pytest.mark.slow)])\ndef test_case(n):\n    pass\n"
    ),
    "tests/support/helper.py": "HELPER = 1\n",
}


def test_the_checker_finds_a_folder_whose_tests_are_all_slow_or_multiprocess(tmp_path):
    for name, text in PLANTED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    fast = fast_tests(tmp_path)
    assert fast == ["tests/alpha/test_alpha.py::test_fast"]
    assert folders_with_tests(tmp_path) == {"tests/alpha", "tests/beta", "tests/gamma"}
    assert folders_without_fast_tests(tmp_path, fast) == {"tests/beta", "tests/gamma"}


def test_the_sessions_fast_tier_drops_slow_and_multiprocess_items_and_needs_every_file(tmp_path):
    """The planted tree's items as this run's collection would hold them: the same fast tier as the
    child pytest finds for it; a run that collected fewer files gives None."""
    for name, text in PLANTED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    class Collected:
        def __init__(self, nodeid, *markers):
            self.nodeid, self.path, self.markers = nodeid, tmp_path / nodeid.split("::")[0], markers

        def get_closest_marker(self, name):
            return name if name in self.markers else None

    items = [Collected("tests/alpha/test_alpha.py::test_fast"), Collected("tests/beta/test_beta.py::test_heavy", "slow"),
             Collected("tests/gamma/test_gamma.py::test_processes", "multiprocess"),
             Collected("tests/gamma/test_gamma.py::test_case[1]", "slow")]
    assert fast_tests_of_this_session(items, tmp_path) == fast_tests(tmp_path) == ["tests/alpha/test_alpha.py::test_fast"]
    assert fast_tests_of_this_session(items[:2], tmp_path) is None, "tests/gamma was not collected"


def test_the_checker_finds_a_package_no_test_imports(tmp_path):
    for name in ("pkg/__init__.py", "pkg/a/__init__.py", "pkg/a/x.py", "pkg/b/__init__.py", "pkg/b/deep/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert packages_not_imported(tmp_path / "pkg", ["from pkg.a.x import f", "import os"]) == {"pkg.b", "pkg.b.deep"}
    assert packages_not_imported(tmp_path / "pkg", ["from pkg.a import x", "from pkg.b import deep"]) == set()


@pytest.mark.timeout(300)
def test_every_package_keeps_a_test_in_the_fast_tier(request):
    packages = {p.parent.name for p in (REPO / "jaxpar").glob("*/__init__.py")}
    folders = folders_with_tests(REPO)
    assert {f"tests/{name}" for name in packages} <= folders, "a jaxpar package without its tests/ folder"
    assert len(folders) >= 12, folders  # the reader found the suite
    fast = fast_tests_of_this_session(request.config.stash[conftest.COLLECTED], REPO) or fast_tests(REPO)
    assert folders_without_fast_tests(REPO, fast) == set()
    # ... and every jaxpar package, subpackages included (pipeline, context, the analysis rooms,
    # each family), is imported by a test file of the fast tier.
    files = sorted({REPO / node.split("::")[0] for node in fast})
    assert packages_not_imported(REPO / "jaxpar", [f.read_text() for f in files]) == set()


# ---- GPU tests: selected by the platform present ----


class Item:
    """What `pytest_runtest_setup` reads of a test: its markers."""

    def __init__(self, *markers):
        self.markers = markers

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def test_gpu_tests_are_skipped_with_the_reason_only_where_there_is_no_gpu(monkeypatch):
    monkeypatch.setattr(conftest, "gpu_devices", lambda: ())
    with pytest.raises(pytest.skip.Exception, match="no GPU on this host"):
        conftest.pytest_runtest_setup(Item("gpu"))
    conftest.pytest_runtest_setup(Item("slow"))  # other tests run on
    monkeypatch.setattr(conftest, "gpu_devices", lambda: ("a GPU device",))
    conftest.pytest_runtest_setup(Item("gpu"))  # a host with a GPU runs them


def test_cpu_stays_the_default_backend_and_cuda_is_listed_only_where_its_plugin_is(monkeypatch):
    assert platforms.suite_platforms({"JAX_PLATFORMS": "cuda"}) == "cuda"  # the user's choice is kept
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: False)
    assert platforms.suite_platforms({}) == "cpu"
    monkeypatch.setattr(platforms, "cuda_plugin_installed", lambda: True)
    assert platforms.suite_platforms({"JAX_PLATFORMS": ""}) == "cpu,cuda"  # jax 0.10: the first listed is the default


def test_the_cuda_plugin_is_found_by_name_without_importing_it(tmp_path):
    for plugin in ("xla_cuda13", "xla_rocm7"):
        (tmp_path / plugin / "jax_plugins" / plugin).mkdir(parents=True)
        (tmp_path / plugin / "jax_plugins" / plugin / "__init__.py").write_text("raise RuntimeError('imported')\n")
    assert platforms.cuda_plugin_installed([tmp_path / "xla_cuda13" / "jax_plugins"])
    assert not platforms.cuda_plugin_installed([tmp_path / "xla_rocm7" / "jax_plugins"])
    assert not platforms.cuda_plugin_installed([])


def test_a_child_run_is_a_cpu_run(monkeypatch):
    from tests.support.compile_flags import subprocess_environment

    monkeypatch.setenv("JAX_PLATFORMS", platforms.CPU_THEN_GPU)
    assert subprocess_environment()["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert subprocess_environment()["JAX_PLATFORMS"] == "cpu"
