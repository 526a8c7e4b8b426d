"""Initialisation never depends on the mesh: the state `build(...).init()` creates on each sharding
pattern holds bitwise the one-device parameters (and model state, such as the router bias), in
the natural layer order.

The degeneracy tests start every layout from the one-device reference's parameters
(`tests/reference.run`), so this is where the rule is proven, once per way a parameter can be cut:
over data (ZeRO-3, over data x context too), over tensor (vocab-parallel tables, heads, a tied
table), over expert (experts per rank, a shared expert, the router bias), and
over pipeline in the schedule's storage order (interleaved and V). It runs in a child process with
XLA:CPU's default fusion emitter, which users run with: under the suite's elemental one
(`tests/support/compile_flags.py`) the vocab-sharded tables differ from one device's by one ulp. LLVM stays
at -O0 and in one module (`tests/support/compile_flags.py`: neither changes the values; at -O2 this test
took 150 CPU-s instead of 40).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.support.compile_flags import DEVICE_COUNT, LLVM_O0, ONE_CODEGEN_MODULE, subprocess_environment
from tests.support.init_worker import LAYOUTS
from tests.support.paths import ROOT

WORKER = os.path.join(ROOT, "tests", "support", "init_worker.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_init_is_bitwise_the_one_device_init_on_every_sharding_pattern():
    # JAXPAR_INIT_FLAGS: other flags for the child (with the fast-compile ones it fails on tensor layouts).
    flags = os.environ.get("JAXPAR_INIT_FLAGS", f"{DEVICE_COUNT} {LLVM_O0} {ONE_CODEGEN_MODULE}")  # the default emitter
    environment = subprocess_environment(XLA_FLAGS=flags, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, WORKER], env=environment, cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for name in LAYOUTS:
        assert found[name + ":leaves"] >= 9, f"{name}: too few parameter leaves compared"
        assert found[name] == [], f"{name}: initial parameters differ from one device's in {found[name]}"
