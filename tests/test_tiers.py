"""The tiers: the contributor's loop (`pytest -m "not slow and not multiprocess"`) keeps a test of
every package.

The fast tier is collected the way a contributor runs it, by pytest in a child process; each
checker first finds what it looks for in a planted tree.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def folders_with_tests(root: Path) -> set[str]:
    """Folders under `root`/tests that hold test files (tests/support holds helpers only)."""
    return {p.parent.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")} - {"tests", "tests/support"}


def folders_without_fast_tests(root: Path) -> set[str]:
    return folders_with_tests(root) - {Path(node.split("::")[0]).parent.as_posix() for node in fast_tests(root)}


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
    assert fast_tests(tmp_path) == ["tests/alpha/test_alpha.py::test_fast"]
    assert folders_with_tests(tmp_path) == {"tests/alpha", "tests/beta", "tests/gamma"}
    assert folders_without_fast_tests(tmp_path) == {"tests/beta", "tests/gamma"}


@pytest.mark.timeout(300)
def test_every_package_keeps_a_test_in_the_fast_tier():
    packages = {p.parent.name for p in (REPO / "jaxpar").glob("*/__init__.py")}
    folders = folders_with_tests(REPO)
    assert {f"tests/{name}" for name in packages} <= folders, "a jaxpar package without its tests/ folder"
    assert len(folders) >= 12, folders  # the reader found the suite
    assert folders_without_fast_tests(REPO) == set()
