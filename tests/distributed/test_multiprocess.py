"""Two processes × 4 CPU devices train exactly like one process × 8: same global batches, same losses.

Each process builds only its own rows of the global batch; the batch content may not depend on how
many processes there are.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.support.compile_flags import subprocess_environment
from tests.support.multiprocess_worker import multiprocess_config, run
from tests.support.paths import ROOT
from tests.support.processes import free_port

pytestmark = pytest.mark.multiprocess  # every test here starts several JAX processes of one run

WORKER = os.path.join(ROOT, "tests", "support", "multiprocess_worker.py")


def _launch(num_processes: int, devices_each: int, out: str):
    env = {k: v for k, v in subprocess_environment().items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, port, str(num_processes), str(i), str(devices_each), out],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(num_processes)
    ]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    with open(out) as f:
        return json.load(f)


def test_two_processes_match_one(tmp_path):
    single = run(multiprocess_config())  # this pytest process: one process, 8 devices
    double = _launch(2, 4, str(tmp_path / "two.json"))
    assert single["checksums"] == double["checksums"]
    assert double["local_rows"] == [8, 8], "each process must hold only its half of the 16 rows"
    assert single["local_rows"] == [16, 16]
    for a, b in zip(single["losses"], double["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a)
