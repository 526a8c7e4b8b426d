"""The workdir: one run at a time (a live holder is named, a killed one's lock is taken over), what an
earlier run left decides resume / refuse, and metrics.jsonl continues as strict JSON without
duplicated or missing steps. No jax compile here: these are file and process checks."""

import fcntl
import json
import os
import socket
from unittest import mock

import pytest

from jaxpar.train import workdir as workdirs
from jaxpar.train.preflight import ConfigError, check_run
from tests.support import tiny
from tests.support.processes import hold_lock


def config():
    return tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 8}, data={"max_corpus_bytes": 100_000})


def test_a_live_run_keeps_others_out_and_a_killed_runs_lock_is_taken_over(tmp_path):
    workdir = tmp_path / "run"
    holder = hold_lock(workdir)
    try:
        with pytest.raises(workdirs.WorkdirBusy) as error:
            workdirs.WorkdirLock(str(workdir)).acquire()
        (line,) = str(error.value).splitlines()
        assert f"host elsewhere, pid {holder.pid}" in line and str(workdir) in line
        # Preflight sees it too, without writing anything.
        with pytest.raises(ConfigError, match=f"in use by another run \\(host elsewhere, pid {holder.pid}"):
            check_run(config(), str(workdir), 8, "cpu")
    finally:
        holder.kill()  # like kill -9: no cleanup, the lock file keeps its content
        holder.wait()
    assert json.loads((workdir / workdirs.LOCK_FILE).read_text())["pid"] == holder.pid
    check_run(config(), str(workdir), 8, "cpu")  # the dead holder's lock is no obstacle
    with workdirs.WorkdirLock(str(workdir)) as lock:
        assert lock.stale == f"host elsewhere, pid {holder.pid}, since then"
        mine = json.loads((workdir / workdirs.LOCK_FILE).read_text())
        assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
    assert not (workdir / workdirs.LOCK_FILE).exists(), "a finished run leaves no lock file behind"
    with workdirs.WorkdirLock(str(workdir)) as lock:
        assert lock.stale is None


def test_a_run_that_opened_the_lock_file_as_its_holder_removed_it_locks_the_new_file(tmp_path):
    """The holder removes `.lock` at its end while a second run has it open: the second run must not
    hold a lock on the removed file, or a third run (creating a new file) would get in beside it."""
    first = workdirs.WorkdirLock(str(tmp_path)).acquire()
    second = workdirs.WorkdirLock(str(tmp_path))
    opened, opens = second._open, []

    def open_as_the_holder_ends(workdir):
        f = opened(workdir)
        if not opens:
            first.release()  # between the second run's open and its flock
        opens.append(f)
        return f

    with mock.patch.object(second, "_open", open_as_the_holder_ends):
        second.acquire()
    assert len(opens) == 2, "the second run locked the removed file"
    with pytest.raises(workdirs.WorkdirBusy, match=f"pid {os.getpid()}"):
        workdirs.WorkdirLock(str(tmp_path)).acquire()
    second.release()
    assert os.listdir(tmp_path) == []


def test_a_run_refused_after_locking_leaves_no_workdir_it_created(tmp_path):
    with workdirs.WorkdirLock(str(tmp_path / "new")):
        assert (tmp_path / "new" / workdirs.LOCK_FILE).exists()
    assert not (tmp_path / "new").exists(), "the workdir the lock created, left empty, is removed"
    with workdirs.WorkdirLock(str(tmp_path / "kept")):
        (tmp_path / "kept" / "metrics.jsonl").write_text("{}\n")
    assert os.listdir(tmp_path / "kept") == ["metrics.jsonl"], "a workdir with a run's files stays"


def test_two_runs_in_one_process_cannot_share_a_workdir(tmp_path):
    with workdirs.WorkdirLock(str(tmp_path)):
        with pytest.raises(workdirs.WorkdirBusy, match=f"pid {os.getpid()}"):
            workdirs.WorkdirLock(str(tmp_path)).acquire()


def test_inspect_decides_fresh_refuse_or_overwrite(tmp_path):
    plan, problems = workdirs.inspect(config(), str(tmp_path / "new"), overwrite=False)
    assert problems == [] and plan.resume_step is None and not plan.overwrite
    assert not (tmp_path / "new").exists(), "inspect never writes"
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    plan, (problem,) = workdirs.inspect(config(), str(earlier), overwrite=False)
    assert plan is None and "holds an earlier run (metrics.jsonl)" in problem and "--overwrite" in problem
    plan, problems = workdirs.inspect(config(), str(earlier), overwrite=True)
    assert problems == [] and plan.overwrite and plan.resume_step is None
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n', "deleted only when the run starts"


def test_metrics_log_continues_strict_json(tmp_path):
    lines = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')
    log = workdirs.MetricsLog(str(tmp_path), resume_step=2)
    log.write({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "router": [1.0, float("-inf")]})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    records = [json.loads(line, parse_constant=lambda t: pytest.fail(f"non-standard token {t}")) for line in text.splitlines()]
    assert records == [lines[0], lines[1], {"step": 3, "loss": None, "grad_norm": None, "router": [1.0, None]}]
    fresh = workdirs.MetricsLog(str(tmp_path), resume_step=None)
    fresh.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_crashed_holder_is_noticed_quickly(tmp_path):
    """The kernel drops a dead process's flock at once: no timeout to wait for."""
    holder = hold_lock(tmp_path)
    holder.kill()
    holder.wait()
    calls = []
    flock = fcntl.flock

    def recorded(f, operation):
        calls.append(operation)
        return flock(f, operation)

    with mock.patch.object(workdirs.fcntl, "flock", recorded), workdirs.WorkdirLock(str(tmp_path)) as lock:
        assert lock.stale is not None
    # Taken by the first, non-blocking try: nothing waited for a timeout (no clock needed).
    assert calls[0] == fcntl.LOCK_EX | fcntl.LOCK_NB, calls


@pytest.mark.parametrize("outside", [False, True], ids=["checkpoints_inside", "checkpoint_dir_elsewhere"])
def test_overwrite_moves_the_earlier_run_aside_then_restores_or_lets_go(tmp_path, outside):
    from jaxpar.train import aside as asides

    workdir = tmp_path / "run"
    ckpt = tmp_path / "elsewhere" if outside else workdir / "checkpoints"
    for path, text in [(workdir / "metrics.jsonl", "1\n"), (workdir / "config.json", "{}"), (workdir / "tensorboard" / "ev", "e"),
                       (ckpt / "3" / "state", "s"), (ckpt / "4.orbax-checkpoint-tmp-1" / "x", "t"), (workdir / ".lock", "")]:
        os.makedirs(path.parent, exist_ok=True)
        path.write_text(text)
    files = lambda: {p: open(p).read() for p in map(str, tmp_path.rglob("*")) if os.path.isfile(p)}  # noqa: E731
    before = files()
    aside = asides.set_aside(str(workdir), str(ckpt), workdirs.RUN_FILES)
    assert not (workdir / "metrics.jsonl").exists() and not (ckpt / "3").exists() and (workdir / ".lock").exists()
    # A process killed now leaves the folder(s), which every later start names.
    run_config = config()
    run_config.checkpoint.dir = str(ckpt)
    plan, problems = workdirs.inspect(run_config, str(workdir), overwrite=True)
    assert problems == [] and sum(folder in note for note in plan.notes for folder in aside.folders) == len(aside.folders)
    # The new run writes its own files, then fails before a checkpoint: all of it goes, the earlier run comes back.
    (workdir / "metrics.jsonl").write_text("new\n")
    os.makedirs(ckpt / "1.orbax-checkpoint-tmp-9")
    aside.restore()
    assert files() == before and not asides.leftovers(str(workdir), str(ckpt))
    # Or it completes a checkpoint: the earlier run is deleted.
    aside = asides.set_aside(str(workdir), str(ckpt), workdirs.RUN_FILES)
    aside.let_go()
    assert not asides.leftovers(str(workdir), str(ckpt)) and not (workdir / "metrics.jsonl").exists()
    assert asides.set_aside(str(workdir), str(ckpt), workdirs.RUN_FILES) is None, "nothing left to move"


def test_a_lock_that_cannot_be_created_is_one_line():
    with pytest.raises(workdirs.WorkdirError) as error:
        workdirs.WorkdirLock("/proc/jaxpar-no-such-run").acquire()
    (line,) = str(error.value).splitlines()
    assert line.startswith("--workdir=/proc/jaxpar-no-such-run: cannot create its lock file /proc/jaxpar-no-such-run/.lock")
