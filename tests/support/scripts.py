"""Running a repository script in a child process, and reading the numbers it prints.

The child gets the suite's fast-compile XLA flags but not its device count (the scripts choose their
own devices), JAX on CPU, and this checkout on its path; it runs in the repository root, so relative
paths such as `configs/llama_tiny.py` work as in the docs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.support.compile_flags import subprocess_environment
from tests.support.paths import ROOT

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def run_script(name: str, *args: str, code: str | None = None, timeout: int = 240, **env) -> subprocess.CompletedProcess:
    """scripts/`name` with `args` (or the Python program `code` with them as its sys.argv[1:])."""
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, os.path.join(ROOT, "scripts", name), *args]
    environment = subprocess_environment(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **env)
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout, cwd=ROOT)


def numbers(text: str) -> list[float]:
    """Every number in `text`, in order."""
    return [float(n) for n in NUMBER.findall(text)]


def fields(line: str) -> dict[str, str]:
    """The `key=value` words of a line."""
    return dict(word.split("=", 1) for word in line.split() if "=" in word)
