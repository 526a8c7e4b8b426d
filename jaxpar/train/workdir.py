"""The run's working directory: what an earlier run left there, one run at a time, nothing clobbered.

WORKDIR holds `config.json`, `metrics.jsonl`, `checkpoints/` (unless `checkpoint.dir` points
elsewhere) and `.lock`. Before anything is written, `inspect` decides what a new run does with it:
- nothing there (or no such directory): a fresh run;
- complete checkpoints whose saved config fits (same model and data; mesh, parallel, steps may
  change — `jaxpar.checkpoint.compare_configs`): resume from the newest;
- anything else of an earlier run (another model or data, or logs without a checkpoint): refused in
  one line naming what differs, unless `--overwrite`, which clears it once the run is known to start.

`WorkdirLock` keeps two runs out of one workdir with `flock` on `.lock`: the kernel drops the lock
when its holder dies, so a lock left by a killed run is stale by construction and simply taken over
(the file's previous content, host and pid, is reported). The second of two live runs gets a
one-line error naming the first's host and pid. Only process 0 of a multi-process run locks.

`MetricsLog` appends one strict-JSON line per step (non-finite floats become null); on resume it
first keeps only the lines up to the restored step, replacing the file atomically, so the log
continues without duplicated or missing steps.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import time
from dataclasses import dataclass

from etils import epath

from jaxpar.checkpoint import CheckpointError, compare_configs
from jaxpar.checkpoint.listing import finished_steps, saved_config, saved_data_state
from jaxpar.checkpoint.manager import is_remote
from jaxpar.data.corpus import corpus_tokens

CONFIG_FILE, METRICS_FILE, LOCK_FILE, CHECKPOINTS = "config.json", "metrics.jsonl", ".lock", "checkpoints"
OVERWRITE_HINT = "pass --overwrite to start afresh (it deletes the earlier run) or choose another --workdir"


class WorkdirBusy(RuntimeError):
    """Another live run holds the workdir; the message is one line naming its host and pid."""


def checkpoint_dir(config, workdir: str) -> str:
    directory = str(config.checkpoint.dir) or os.path.join(workdir, CHECKPOINTS)
    return directory if is_remote(directory) else os.path.abspath(directory)


@dataclass(frozen=True)
class WorkdirPlan:
    workdir: str
    checkpoint_dir: str
    resume_step: int | None  # the newest complete checkpoint that fits the config; None: fresh run
    overwrite: bool  # clear the earlier run's files when the run starts
    notes: tuple[str, ...]  # one line each, printed at start


def _directory_problem(path: str, key: str) -> str | None:
    """Why `path` cannot be (made) a writable directory, or None."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"{key}={path} is a file, not a directory; choose a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{key}={path} is not writable; choose a writable directory"
        return None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{key}={path} cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{key}={path} cannot be created: {parent} is not writable"
    return None


def _earlier_run_files(workdir: str) -> list[str]:
    return [name for name in (METRICS_FILE, CONFIG_FILE) if os.path.isfile(os.path.join(workdir, name))]


def lock_holder(workdir: str) -> str | None:
    """"host H, pid P, since T" of a live run holding the workdir's lock, else None. Reads only."""
    path = os.path.join(workdir, LOCK_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe_holder(f.read())
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"host {holder['host']}, pid {holder['pid']}, since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "an unknown process"


def inspect(config, workdir: str, *, overwrite: bool) -> tuple[WorkdirPlan | None, list[str]]:
    """(plan, problems): what a run of `config` would do with `workdir`, deciding only by reading."""
    ckpt_dir = checkpoint_dir(config, workdir)
    problems = [p for p in [_directory_problem(workdir, "--workdir")] if p]
    inside = os.path.abspath(ckpt_dir).startswith(os.path.abspath(workdir) + os.sep)
    if not is_remote(ckpt_dir) and not (problems and inside) and (p := _directory_problem(ckpt_dir, "checkpoint.dir")):
        problems.append(p)
    if problems:
        return None, problems
    if (holder := lock_holder(workdir)) is not None:
        return None, [f"--workdir={workdir} is in use by another run ({holder}); wait for it or choose another --workdir"]
    # Interrupted saves are reported (and removed) by `jaxpar.checkpoint.Checkpoints` when it opens.
    notes = []
    steps = finished_steps(ckpt_dir)
    earlier = _earlier_run_files(workdir) if os.path.isdir(workdir) else []
    if overwrite:
        if steps or earlier:
            notes.append(f"--overwrite: the earlier run in {workdir} (checkpoints {steps or 'none'}) is deleted when this run starts")
        return WorkdirPlan(workdir, ckpt_dir, None, bool(steps or earlier), tuple(notes)), []
    current = json.loads(config.to_json_best_effort())
    for step in reversed(steps):
        try:
            saved = saved_config(ckpt_dir, step)
        except CheckpointError as e:
            notes.append(f"{e}; trying an older checkpoint")
            continue
        try:
            notes += compare_configs(saved, current, checkpoint=os.path.join(ckpt_dir, str(step)))
            corpus_problem = _corpus_changed(config, ckpt_dir, step)
        except CheckpointError as e:
            return None, [f"{e}; {OVERWRITE_HINT}"]
        if corpus_problem:
            return None, [f"{corpus_problem}; {OVERWRITE_HINT}"]
        return WorkdirPlan(workdir, ckpt_dir, step, False, tuple(notes)), []
    if steps:
        return None, [f"checkpoint.dir={ckpt_dir} holds checkpoints {steps} but none with a readable config; {OVERWRITE_HINT}"]
    if earlier:
        return None, [
            f"--workdir={workdir} holds an earlier run ({', '.join(earlier)}) but no complete checkpoint in {ckpt_dir} "
            f"to resume from; {OVERWRITE_HINT}"
        ]
    return WorkdirPlan(workdir, ckpt_dir, None, False, tuple(notes)), []


def corpus_changed_problem(path: str, saved: int, now: int) -> str:
    return (
        f"checkpoint {path} was saved reading a corpus of {saved} tokens but the corpus now has {now}: "
        f"its data position would point elsewhere; restore the corpus"
    )


def _corpus_changed(config, ckpt_dir: str, step: int) -> str | None:
    """Same data config but another corpus (a token file rewritten, a folder grown)?"""
    saved = saved_data_state(ckpt_dir, step).get("corpus_tokens")
    try:
        now = corpus_tokens(config.data)
    except (OSError, ValueError):
        return None  # the data preflight reports an unreadable corpus
    if saved is None or saved == now:
        return None
    return corpus_changed_problem(os.path.join(ckpt_dir, str(step)), saved, now)


class WorkdirLock:
    """`flock` on WORKDIR/.lock for the lifetime of the run (see the module docstring)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._file = None
        self.stale: str | None = None  # the previous holder, if the lock was left by a killed run

    def acquire(self) -> "WorkdirLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _describe_holder(f.read())
            f.close()
            raise WorkdirBusy(
                f"--workdir={os.path.dirname(self.path)} is in use by another run ({holder}); "
                f"wait for it or choose another --workdir"
            ) from None
        f.seek(0)
        previous = f.read()
        if previous.strip():
            self.stale = _describe_holder(previous)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}))
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()  # an empty lock file: nobody holds it, nothing stale
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _replace_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def clear_earlier_run(plan: WorkdirPlan) -> None:
    """--overwrite, once the run is known to start: delete the earlier run's logs and checkpoints."""
    for name in (METRICS_FILE, CONFIG_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(plan.workdir, name))
    ckpt = epath.Path(plan.checkpoint_dir)
    if not ckpt.exists():
        return
    for child in ckpt.iterdir():
        # Only what Orbax and jaxpar put there: step directories, interrupted and quarantined saves.
        if child.name.split(".")[0].isdigit() and child.is_dir():
            child.rmtree()


def write_config(workdir: str, config) -> None:
    _replace_text(os.path.join(workdir, CONFIG_FILE), config.to_json_best_effort(indent=2) + "\n")


def strict_json(record: dict) -> str:
    """One JSON line that strict readers accept: NaN / inf become null."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps({k: clean(v) for k, v in record.items()}, allow_nan=False)


class MetricsLog:
    """WORKDIR/metrics.jsonl, continued from `resume_step` (None: started empty). Process 0 writes."""

    def __init__(self, workdir: str, resume_step: int | None, *, writer: bool = True):
        self.path, self._file = os.path.join(workdir, METRICS_FILE), None
        if not writer:
            return
        kept = []
        if resume_step is not None and os.path.isfile(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # e.g. a line cut short by a kill
                    if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= resume_step:
                        kept.append(strict_json(record))
        _replace_text(self.path, "".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(strict_json(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
