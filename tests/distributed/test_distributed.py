"""Multi-process: scripts/launch_local.py, jaxpar.distributed.initialize, and checkpoints written by
2 processes × 4 CPU devices restored by 1 process × 8 devices onto another mesh (bit-identical to
the state gathered from the writers), plus the shared-storage check failing on per-process dirs."""

import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxpar import distributed
from jaxpar.checkpoint import Checkpoints
from jaxpar.checkpoint.integrity import leaf_names
from tests.support.checkpoint_worker import target_abstract, target_program
from tests.support.paths import ROOT
from tests.support.restored import assert_on_shardings

LAUNCH = os.path.join(ROOT, "scripts", "launch_local.py")
WORKER = os.path.join(ROOT, "tests", "support", "checkpoint_worker.py")


def launch(args: list[str], processes: int = 2, devices: int = 4, timeout: int = 240):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, LAUNCH, f"--processes={processes}", f"--devices_per_process={devices}", "--", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def test_launch_local_sets_the_environment_and_prefixes_output():
    names = ["JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS", "JAX_COORDINATOR_ADDRESS"]
    show = f"import os; print(*[os.environ[n] for n in {names}], 'device_count' in os.environ.get('XLA_FLAGS', ''))"
    done = launch([sys.executable, "-c", show], processes=3, devices=2, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line.split() for line in done.stdout.splitlines() if line.startswith("["))
    # conftest's forced device count must not reach the processes (it would fight JAX_NUM_CPU_DEVICES).
    assert [line[:5] + line[6:] for line in lines] == [[f"[{i}]", str(i), "3", "2", "cpu", "False"] for i in range(3)]
    addresses = {line[5] for line in lines}
    assert len(addresses) == 1 and addresses.pop().startswith("127.0.0.1:")


# What Gloo prints as each process joins a communicator (seen in a 2 x 4 run of scripts/train.py).
GLOO = "[Gloo] Rank {rank} is connected to {peers} peer ranks. Expected number of connected peer ranks is : {expected}"


def test_launch_local_leaves_out_gloos_connection_lines_and_says_once_why_it_is_slower():
    """A connection that reached all its peers is chatter, taken out wherever Gloo's threads cut it into
    a line (as seen in that run); one short of its peers is kept (a real problem)."""
    whole = GLOO.format(rank="{r}", peers=7, expected=7)
    code = (
        "import os; r = os.environ['JAX_PROCESS_ID']\n"
        f"print({whole!r}.format(r=r)); print({GLOO!r}.format(rank=r, peers=1, expected=2))\n"
        f"print('checking ...', end='', flush=True); print({whole!r}.format(r=r))\n"  # the program's line, cut
        f"print({whole.split('Expected')[0]!r}.format(r=r) + {whole!r}.format(r=r))\n"  # two threads' pieces
        "print('Expected number of connected peer ranks is : 7'); print('step', r)\n"
    )
    done = launch([sys.executable, "-c", code], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(done.stdout.splitlines()) == [
        f"[{i}] {text}" for i in range(2) for text in (GLOO.format(rank=i, peers=1, expected=2), "checking ...", f"step {i}")
    ]
    assert done.stderr.count("collectives go through Gloo over TCP") == 1, done.stderr


def test_launch_local_stops_the_others_when_one_fails(tmp_path):
    # Process 0 prints its pid, marks that it did, then sleeps far past the launch's timeout (a hang
    # guard, not a measurement); process 1 fails once the mark exists. Stopped means gone when
    # launch_local returns.
    mark = tmp_path / "started"
    fail_one = (
        "import os, sys, time; p = os.environ['JAX_PROCESS_ID']\n"
        "if p == '0':\n    print('pid', os.getpid(), flush=True); open(sys.argv[1], 'w').close(); time.sleep(600)\n"
        "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n"
        "sys.exit(3)\n"
    )
    done = launch([sys.executable, "-c", fail_one, str(mark)], timeout=240)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "[launch_local] process 1 exited with 3" in done.stdout
    (pid,) = [int(line.split()[-1]) for line in done.stdout.splitlines() if " pid " in line]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the sleeping process was stopped (and reaped)


def test_launch_local_names_the_process_that_died_and_why():
    die = "import os, signal, time; os.kill(os.getpid(), signal.SIGKILL) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(120)"
    done = launch([sys.executable, "-c", die], timeout=60)
    assert done.returncode == 128 + 9, done.stdout + done.stderr
    assert "[launch_local] process 1 was killed by SIGKILL (out of memory? a kill -9? a lost node?); stopping the others" in done.stdout


def test_initialize_is_a_no_op_without_a_multiprocess_setting(monkeypatch):
    for name in (
        distributed.COORDINATOR_ENV,
        distributed.NUM_PROCESSES_ENV,
        distributed.PROCESS_ID_ENV,
        *distributed.SLURM_ENV,
    ):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False
    monkeypatch.setenv(distributed.COORDINATOR_ENV, "127.0.0.1:1234")
    with pytest.raises(
        distributed.DistributedError,
        match=r"missing num_processes \(JAX_NUM_PROCESSES\), process_id \(JAX_PROCESS_ID\)",
    ):
        distributed.initialize()
    with pytest.raises(distributed.DistributedError, match=r"JAX_PROCESS_ID=2 must be in \[0, JAX_NUM_PROCESSES=2\)"):
        distributed.initialize(num_processes=2, process_id=2)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_processes_save_one_process_restores(tmp_path):
    directory, reference = str(tmp_path / "checkpoints"), str(tmp_path / "reference.npz")
    start = time.perf_counter()
    done = launch([sys.executable, WORKER, "save_multiprocess", directory, reference])
    print(f"2 processes x 4 devices (check, build, save 2 steps, damage, restore): {time.perf_counter() - start:.1f}s")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert (
        "[0] 2-process restore fell back to step 3" in done.stdout and "[1] 2-process restore fell back" in done.stdout
    )
    # Every process wrote its own shards (Orbax keeps one OCDBT store per process), and fingerprints.
    step3 = os.path.join(directory, "3")
    assert sorted(d for d in os.listdir(os.path.join(step3, "state")) if d.startswith("ocdbt.process_")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    assert os.path.isdir(os.path.join(step3, "integrity")) and os.path.isdir(os.path.join(directory, "4.unreadable"))

    target = target_program({"tensor": 8}, 8)
    with Checkpoints(directory, every_steps=1, read_only=True) as checkpoints:
        start = time.perf_counter()
        restored = checkpoints.restore(None, target_abstract(target))
        print(f"1 process x 8 devices restore: {time.perf_counter() - start:.2f}s")
    assert restored.step == 3 and restored.data_state == {"step": 3} and restored.notes == ()
    expected = np.load(reference)
    names = leaf_names(restored.state)
    assert sorted(names) == sorted(expected.files)
    for name, leaf in zip(names, jax.tree.leaves(restored.state)):
        np.testing.assert_array_equal(np.asarray(leaf), expected[name], err_msg=name)
    assert_on_shardings(restored.state, target.state_shardings)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_shared_storage_check_fails_when_processes_see_different_dirs(tmp_path):
    done = launch([sys.executable, WORKER, "shared_check", str(tmp_path / "private_")])
    assert done.returncode == 3, done.stdout[-4000:] + done.stderr[-2000:]
    errors = [line for line in done.stdout.splitlines() if "CheckpointError:" in line]
    assert errors, done.stdout[-4000:]
    expected = f"checkpoint.dir={tmp_path / 'private_'}"
    assert all(
        f"{expected}" in line and "is not shared between processes (process 1 cannot see" in line for line in errors
    ), errors
