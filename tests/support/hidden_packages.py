"""Child processes in which some packages cannot be imported, as if they were not installed.

`sys.modules[name] = None` makes `import name` fail in the child; the tests that use this check that
the simulation bites before trusting what jaxpar prints.
"""

import os
import subprocess
import sys

from tests.support.paths import ROOT


def run_without(modules: list[str], code: str) -> subprocess.CompletedProcess:
    """`code` in a child Python in which `modules` cannot be imported."""
    hide = f"import sys\nfor _name in {modules!r}:\n    sys.modules[_name] = None\n"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", hide + code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)


def train_without(modules: list[str], *args: str) -> subprocess.CompletedProcess:
    """scripts/train.py on configs/llama_tiny.py with `args`, in a child without `modules`."""
    argv = ["train.py", "--config=configs/llama_tiny.py", *args]
    return run_without(modules, f"import runpy\nsys.argv = {argv!r}\nrunpy.run_path('scripts/train.py', run_name='__main__')")
