"""Automatic restarts: `scripts/launch_local.py --max_restarts=N` on a run that loses a process three
times — once mid-step, once mid-save, once mid-eval, in an order, at steps and on processes drawn
from a seeded generator. Each moment is found by watching the run's files, never by sleeping: a step's
line in metrics.jsonl (mid-step), an Orbax temporary checkpoint folder (mid-save), the goodput ledger's
`current` kind, written as an evaluation starts (mid-eval). The victim is SIGKILLed; the launcher
stops the other process, relaunches both from the newest complete checkpoint, and the run finishes.

References: the same command without kills (same 2 processes x 2 devices, so the same collectives;
one run, shared with the lost-host test):
losses, gradient norms and evaluations are bitwise equal. Theory for the goodput: every lost
second of each killed start is exactly the `step_s` its own metrics.jsonl lines gave the steps
after the checkpoint the next start resumed from (read after the kill, before the relaunch cuts
them), and over the four starts productive time is the sum of `step_s` over the final metrics.jsonl.
Without processes: which exit codes are retried, and the backoff, in closed form.
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from filelock import FileLock

from jaxpar.train import goodput
from jaxpar.train.observe import TIMING_FIELDS
from tests.support.compile_flags import subprocess_environment
from tests.support.files import write
from tests.support.paths import ROOT
from tests.train.probe import script

LAUNCH = os.path.join(ROOT, "scripts", "launch_local.py")
TRAIN = os.path.join(ROOT, "scripts", "train.py")
SEED, STEPS = 40, 21
WAIT_S = 400  # for any one moment to come (a start on a loaded 2-core host takes tens of seconds)

# Both runs with processes (three kills; a lost host) train this config, and share one reference:
# the same command without a fault (`reference`). Data -1: the elastic run shrinks it to one host's.
CONFIG_FILE = f"""
from tests.support import tiny
def get_config():
    c = tiny.with_overrides(tiny.llama(vocab_size=256), {{"data": -1, "tensor": 2}}, data={{"max_corpus_bytes": 100_000}},
                            train={{"steps": {STEPS}, "peak_flops_per_device": 1e12}}, checkpoint={{"every_steps": 3}})
    c.eval.share, c.eval.every_steps = 0.1, 4
    return c
"""


def launch(tmp_path, name, max_restarts):
    config = write(tmp_path / "config.py", CONFIG_FILE)
    workdir = tmp_path / name
    out = open(tmp_path / f"{name}.txt", "w")
    process = subprocess.Popen(
        [sys.executable, LAUNCH, "--processes=2", "--devices_per_process=2", f"--max_restarts={max_restarts}", "--backoff_s=0.5",
         "--", sys.executable, TRAIN, f"--config={config}", f"--workdir={workdir}"],
        stdout=out, stderr=subprocess.STDOUT, env=subprocess_environment(PYTHONPATH=ROOT), start_new_session=True,
    )
    return process, workdir, out


@pytest.fixture(scope="session")
def reference(tmp_path_factory, worker_id):
    """The workdir of CONFIG_FILE's run without faults (2 processes x 2 devices, data 2 x tensor 2),
    made once per session: the xdist workers share it."""
    root = tmp_path_factory.getbasetemp()
    root = (root if worker_id == "master" else root.parent) / "restarts_reference"
    root.mkdir(exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if not (root / "done").exists():
            process, workdir, out = launch(root, "reference", max_restarts=0)
            code = process.wait(timeout=WAIT_S)
            out.close()
            assert code == 0, (root / "reference.txt").read_text()[-4000:]
            (root / "done").write_text("")
    return root / "reference"


def children(pid) -> dict[int, int]:
    """{JAX process id: pid} of the launcher's running children."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for child in pids:
            try:
                with open(f"/proc/{child}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
                found[int(env[b"JAX_PROCESS_ID"])] = child
            except (OSError, KeyError, ValueError):
                continue
    return found


def metrics(workdir, complete_only=True) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n") or not complete_only]


def until(condition, launcher, what, every=0.02):
    """Polls `condition` until it gives something; a kill's moment (a save in flight lasts tens of
    ms) is looked for every 2 ms, the rest every 20 ms (each look reads the ledger and the metrics:
    polling them all at 2 ms took CPU from the suite's other worker)."""
    deadline = time.monotonic() + WAIT_S
    while (found := condition()) is None:
        assert launcher.poll() is None, f"the launcher ended ({launcher.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s"
        time.sleep(every)
    return found


def in_start(workdir, start):
    """The ledger's attempts once start `start` (1-based) has opened, else None."""
    attempts = goodput.read(workdir)
    return attempts if len(attempts) == start else None


def moment(kind, workdir, start, step):
    """A condition true at the moment of `kind` in start `start`: step `step` logged, a save in flight, an eval."""
    checkpoints, left_over = os.path.join(workdir, "checkpoints"), []

    def saves_in_flight():
        return {n for n in (os.listdir(checkpoints) if os.path.isdir(checkpoints) else []) if ".orbax-checkpoint-tmp" in n}

    def condition():
        attempts = in_start(workdir, start)
        if attempts is None:
            return None
        if not left_over:  # the save a kill interrupted, until this start's Orbax removes it: not this start's
            left_over.append(saves_in_flight())
        if kind == "step":
            return True if any(r.get("step") == step and "loss" in r for r in metrics(workdir)) else None
        if kind == "save":
            mine = [n for n in saves_in_flight() - left_over[0] if int(n.split(".")[0]) <= attempts[-1]["last_step"]]
            return True if mine else None
        return True if attempts[-1].get("current") == "eval" else None

    return condition


def untimed(records):
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records if "goodput" not in r]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_three_kills_at_random_moments_the_run_finishes_bitwise_and_goodput_counts_each_loss(tmp_path, reference):
    rng = random.Random(SEED)
    plan = [(kind, rng.randrange(2)) for kind in rng.sample(["step", "save", "eval"], 3)]
    launcher, workdir, out = launch(tmp_path, "run", max_restarts=len(plan))
    killed = []  # per kill: (kind, victim, metrics.jsonl and ledger once every process of that start is gone)
    try:
        for i, (kind, victim) in enumerate(plan):
            start = i + 1
            attempts = until(lambda s=start: in_start(workdir, s), launcher, f"start {start}")
            step = attempts[-1]["first_step"] + 1 + rng.randrange(3)
            pids = until(lambda: children(launcher.pid) if len(children(launcher.pid)) == 2 else None, launcher, "2 processes")
            until(moment(kind, workdir, start, step), launcher, f"a {kind} in start {start}", every=0.002)
            os.kill(pids[victim], signal.SIGKILL)
            until(lambda p=pids: True if not set(p.values()) & set(children(launcher.pid).values()) else None, launcher,
                  "the other process to stop")
            killed.append((kind, victim, metrics(workdir), goodput.read(workdir)[-1]))
            print(f"start {start}: killed process {victim} {kind} (after step {killed[-1][3]['last_step']})")
        assert launcher.wait(timeout=WAIT_S) == 0, (tmp_path / "run.txt").read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        out.close()
    output = (tmp_path / "run.txt").read_text()
    final, expected = metrics(workdir), metrics(reference)
    assert [r["step"] for r in final if "loss" in r] == list(range(1, STEPS + 1))
    assert untimed(final) == untimed(expected), "losses, gradient norms and evaluations bitwise as without kills"

    attempts = goodput.read(workdir)
    # A killed process 0 records no end; a survivor records the error that ended it (a lost peer's).
    assert len(attempts) == 4 and "done" not in [a["ended"] for a in attempts[:3]] and attempts[3]["ended"] == "done"
    print("\n".join(line for line in output.splitlines() if "goodput" in line or "[launch_local]" in line))
    assert output.count("] goodput: the fault before this start lost") == 3, "every kill lost steps, and each restart says so"
    for k, (kind, _, lines, at_kill) in enumerate(killed):
        resumed_from = attempts[k + 1]["first_step"]
        redone = [r["step_s"] for r in lines if "loss" in r and resumed_from < r["step"] <= at_kill["last_step"]]
        assert math.isclose(attempts[k]["seconds"]["lost"], sum(redone), rel_tol=1e-9, abs_tol=1e-12), (k, kind)
        assert math.isclose(attempts[k]["seconds"]["productive"] + attempts[k]["seconds"]["lost"], attempts[k]["trained_s"])
        if kind == "eval":
            assert at_kill["current"] == "eval", "killed inside an evaluation"
        kinds = goodput.account(attempts[k])
        assert math.isclose(sum(kinds.values()), attempts[k]["updated"] - attempts[k]["started"], rel_tol=1e-9)
    total = goodput.totals(attempts)
    assert math.isclose(total["productive"], sum(r["step_s"] for r in final if "loss" in r), rel_tol=1e-9), "nothing twice"
    assert total["restart"] > 0 and total["lost"] >= sum(attempts[k]["seconds"]["lost"] for k in range(3))
    record = [r for r in final if "goodput" in r][-1]
    assert record["goodput_starts"] == 4 and math.isclose(record["goodput_lost_s"], total["lost"], rel_tol=1e-9)


@pytest.mark.parametrize("status, again", [
    (0, False), (2, False), (3, False), (130, False), (-signal.SIGINT, False),
    (1, True), (4, True), (134, True), (143, True), (-signal.SIGKILL, True), (-signal.SIGTERM, True),
])
def test_which_exits_are_retried(status, again):
    """scripts/train.py's exit codes (its docstring): bad input and non-finite stops fail the same way
    again, a Ctrl-C is a person's decision; a lost process, a lost peer, JAX's fatal exit and a
    preemption are what restarts are for."""
    assert script("launch_local").retried(status) is again


def test_restarts_back_off_and_stop_at_the_limit_or_at_a_final_exit(monkeypatch):
    launcher = script("launch_local")
    statuses, slept = iter([-signal.SIGKILL, 4, 134, 0]), []
    monkeypatch.setattr(launcher, "launch", lambda *args, **kwargs: next(statuses))
    assert launcher.launch_with_restarts(["x"], 2, 1, max_restarts=5, backoff_s=1.5, sleep=slept.append) == 0
    assert slept == [1.5, 3.0, 6.0]
    statuses, slept = iter([4] * 10), []
    assert launcher.launch_with_restarts(["x"], 2, 1, max_restarts=7, backoff_s=10, sleep=slept.append) == 4
    assert slept == [10, 20, 40, 60, 60, 60, 60], "doubled, at most MAX_BACKOFF_S, max_restarts of them"
    statuses, slept = iter([-signal.SIGKILL, 2, 0]), []
    assert launcher.launch_with_restarts(["x"], 2, 1, max_restarts=5, backoff_s=1, sleep=slept.append) == 2
    assert slept == [1], "bad input ends the launcher"


def test_elastic_launches_on_what_the_hosts_file_allows_and_grows_back(tmp_path, monkeypatch):
    """The launcher's side of `--elastic --hosts_file`, in closed form: a lost process with one host gone
    relaunches on one process (a restart), a grown count stops the run and relaunches on two (no
    restart used), a count of 0 waits."""
    launcher, hosts = script("launch_local"), tmp_path / "hosts"
    hosts.write_text("2\n")
    launched, slept = [], []

    def fake_launch(command, processes, devices, env, grows):
        launched.append(processes)
        if len(launched) == 1:
            hosts.write_text("1\n")  # the scheduler drops the lost host
            return -signal.SIGKILL
        if len(launched) == 2:
            assert not grows()
            hosts.write_text("2\n")
            assert grows()
            return launcher.GROW
        return 0

    def sleep(seconds):
        slept.append(seconds)
        if hosts.read_text() == "0\n":
            hosts.write_text("2\n")

    monkeypatch.setattr(launcher, "launch", fake_launch)
    assert launcher.launch_with_restarts(["x"], 2, 2, max_restarts=1, backoff_s=0.5, sleep=sleep, hosts_file=str(hosts)) == 0
    assert launched == [2, 1, 2] and slept == [0.5], "one restart (the kill); growing back used none"
    hosts.write_text("0\n")
    launched.clear()
    assert launcher.available(2, str(hosts), 2, sleep=sleep) == 2 and slept[-1] == 1.0, "no host: it waits"
    assert launcher.hosts_problem(str(hosts)) is None and "at least 1" in launcher.hosts_problem(str(write(tmp_path / "z", "0")))
    assert "must hold the number" in launcher.hosts_problem(str(tmp_path / "absent"))


def start_launcher(tmp_path, name, config, *flags):
    out = open(tmp_path / f"{name}.txt", "w")
    process = subprocess.Popen(
        [sys.executable, LAUNCH, "--processes=2", "--devices_per_process=2", "--backoff_s=0.5", *flags,
         "--", sys.executable, TRAIN, f"--config={config}", f"--workdir={tmp_path / name}"],
        stdout=out, stderr=subprocess.STDOUT, env=subprocess_environment(PYTHONPATH=ROOT), start_new_session=True)
    return process, out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_a_run_loses_a_host_continues_on_one_and_grows_back(tmp_path, reference):
    """2 processes x 2 devices (data 2 x tensor 2); one host is lost (SIGKILL, the hosts file says 1):
    the run continues on 1 process (data 1 x tensor 2) from the newest checkpoint; the host returns
    (the file says 2): the run stops at a checkpoint and continues on 2. Reference: the same run
    uninterrupted (shared with the test above); the losses and evaluations within the cross-mesh
    tolerance (another data axis sums the gradients in another order), every step once; growing back
    loses no step."""
    config, hosts = write(tmp_path / "config.py", CONFIG_FILE), tmp_path / "hosts"
    hosts.write_text("2\n")
    workdir = tmp_path / "run"
    launcher, out = start_launcher(tmp_path, "run", config, "--elastic", f"--hosts_file={hosts}", "--max_restarts=1")
    try:
        until(lambda: True if any(r.get("step") == 4 for r in metrics(workdir)) else None, launcher, "step 4")
        pids = until(lambda: children(launcher.pid) if len(children(launcher.pid)) == 2 else None, launcher, "2 processes")
        hosts.write_text("1\n")
        os.kill(pids[1], signal.SIGKILL)
        resumed = until(lambda: in_start(workdir, 2), launcher, "start 2")[-1]["first_step"]
        until(lambda: True if any(r.get("step") == resumed + 2 for r in metrics(workdir)) else None, launcher, "2 steps")
        hosts.write_text("2\n")
        assert launcher.wait(timeout=WAIT_S) == 0, (tmp_path / "run.txt").read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        out.close()
    output = (tmp_path / "run.txt").read_text()
    meshes = [line.split("mesh: ", 1)[1] for line in output.splitlines() if line.startswith("[0]") and "mesh: " in line]
    assert [m.split(" on ")[1] for m in meshes] == ["4 cpu devices", "2 cpu devices", "4 cpu devices"], meshes
    assert output.count("restart 1 of 1") == 1 and "stopping at a checkpoint to continue on them" in output
    assert output.count("elastic: 2 of 4 devices, 1 data replicas instead of 2: train.grad_accum=2 keeps") == 1, \
        "on one host the accumulation doubles: the same rows per device, the same global batch"
    final, expected = untimed(metrics(workdir)), untimed(metrics(reference))
    assert [r["step"] for r in final if "loss" in r] == list(range(1, STEPS + 1)), "every step once, the data position exact"
    for got, want in zip(final, expected, strict=True):  # steps and evaluations, in order
        key = "loss" if "loss" in want else "eval_loss"
        assert got.keys() == want.keys() and abs(got[key] - want[key]) <= 1e-4 * abs(want[key]), (got, want)
    attempts = goodput.read(workdir)
    assert len(attempts) == 3 and attempts[1]["seconds"].get("lost", 0.0) == 0.0, "stopping to grow lost nothing"
