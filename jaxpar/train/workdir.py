"""The run's working directory: what an earlier run left there, one run at a time, nothing clobbered.

WORKDIR holds `config.json`, `metrics.jsonl`, `goodput.json` (`jaxpar.train.goodput`),
`checkpoints/` (unless `checkpoint.dir` points elsewhere) and `.lock`. Before anything is
written, `inspect` decides what a new run does with it:
- nothing there (or no such directory): a fresh run;
- complete checkpoints whose saved config fits (same model and data; mesh, parallel, steps may
  change — `jaxpar.checkpoint.compare_configs`): resume from the newest;
- logs of a run of the same model and data that wrote no checkpoint (it failed or was killed
  before its first): replaced, as by `--overwrite` — rerunning the command is what it asks for;
- anything else of an earlier run (another model or data, logs of another config without a
  checkpoint): refused in one line naming what differs, unless `--overwrite`.
Replacing never deletes first: the earlier run is moved aside when the new run is known to start and
deleted only at the new run's first complete checkpoint (`jaxpar.train.aside`). A `previous-*`
folder left by a killed replacement is named at every start.

`WorkdirLock` keeps two runs out of one workdir with `flock` on `.lock`: the kernel drops the lock
when its holder dies, so a lock left by a killed run is stale by construction and simply taken over
(the file's previous content, host and pid, is reported). The second of two live runs gets a
one-line error naming the first's host and pid. A run that ends — done, refused or failed — removes
`.lock` while still holding it, so a finished workdir holds only the run's files; a run that opened
the file just before that finds, once it has the lock, that the path no longer names its file, and
locks the path's new file instead (two runs never hold locks on two different files). Only process
0 of a multi-process run locks. A local checkpoint directory is locked the same way (its own
`.lock`): two runs of different workdirs naming one `checkpoint.dir` would otherwise resume from and
train into the same checkpoints. A directory a lock created is removed at release if the run left
it empty (a run refused after locking writes nothing).

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

from jaxpar import trackers
from jaxpar.checkpoint import CheckpointError, compare_configs
from jaxpar.checkpoint.listing import converted_from, finished_steps, saved_config, saved_data_state
from jaxpar.checkpoint.storage import is_remote, remote_problem
from jaxpar.checkpoint.tiers import local_dir
from jaxpar.data.corpus import corpus_fingerprint, corpus_tokens
from jaxpar.train import aside as asides
from jaxpar.train.goodput import LEDGER_FILE

CONFIG_FILE, METRICS_FILE, LOCK_FILE, CHECKPOINTS = "config.json", "metrics.jsonl", ".lock", "checkpoints"
# A run's files and folders in its workdir besides checkpoints (profile: jaxpar.train.observe's; goodput.json:
# jaxpar.train.goodput's ledger; the trackers' folders and run ids: jaxpar.trackers').
RUN_FILES = (METRICS_FILE, CONFIG_FILE, LEDGER_FILE, "profile", trackers.IDS_FILE, *trackers.FOLDERS)
OVERWRITE_HINT = (
    "pass --overwrite to replace it (it is kept aside until the new run's first checkpoint) or choose another --workdir"
)


class WorkdirError(RuntimeError):
    """The workdir cannot be used (its lock cannot be created); the message is one line."""


class WorkdirBusy(WorkdirError):
    """Another live run holds the workdir; the message is one line naming its host and pid."""


def checkpoint_dir(config, workdir: str) -> str:
    directory = str(config.checkpoint.dir) or os.path.join(workdir, CHECKPOINTS)
    return directory if is_remote(directory) else os.path.abspath(directory)


@dataclass(frozen=True)
class WorkdirPlan:
    workdir: str
    checkpoint_dir: str
    resume_step: int | None  # the newest complete checkpoint (of either tier) that fits the config; None: fresh run
    overwrite: bool  # move the earlier run's files aside when the run starts (`jaxpar.train.aside`)
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
    """"host H, pid P, since T" of a live run holding the lock of a workdir (or of a checkpoint
    directory), else None. Reads only."""
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
    if p := remote_problem(ckpt_dir):
        problems.append(p)
    local = local_dir(config)
    if local and (p := _directory_problem(local, "checkpoint.local_dir")):
        problems.append(p)
    if problems:
        return None, problems
    if (holder := lock_holder(workdir)) is not None:
        return None, [busy_line("--workdir", workdir, holder)]
    if locks_checkpoint_dir(workdir, ckpt_dir) and (holder := lock_holder(ckpt_dir)) is not None:
        return None, [busy_line("checkpoint.dir", ckpt_dir, holder)]
    if local and (holder := lock_holder(local)) is not None:
        return None, [busy_line("checkpoint.local_dir", local, holder)]
    # Interrupted saves are reported (and removed) by `jaxpar.checkpoint.Checkpoints` when it opens.
    notes = []
    steps = finished_steps(ckpt_dir)
    earlier = _earlier_run_files(workdir) if os.path.isdir(workdir) else []
    converted = converted_from(ckpt_dir, steps)
    if overwrite and converted:
        return None, [
            f"checkpoint.dir={ckpt_dir} holds checkpoint {converted[0]}, converted from {converted[1]} by scripts/convert.py; "
            f"--overwrite never deletes a converted checkpoint: drop --overwrite to train from it, or choose another "
            f"checkpoint.dir"
        ]
    notes += [
        f"{folder} holds a run an --overwrite replaced, kept because the replacing run was killed before its first "
        f"checkpoint; move its files back to resume it, or delete it" for folder in asides.leftovers(workdir, ckpt_dir)
    ]
    replacing = "is moved aside when this run starts, deleted at its first checkpoint and restored if it fails before"
    local_steps = [s for s in finished_steps(local) if s not in steps] if local else []
    if overwrite:
        if steps or earlier or local_steps:
            local_note = f" and the local tier's checkpoints {local_steps} are deleted" if local_steps else ""
            notes.append(f"--overwrite: the earlier run in {workdir} (checkpoints {steps or 'none'}) {replacing}{local_note}")
        return WorkdirPlan(workdir, ckpt_dir, None, bool(steps or earlier or local_steps), tuple(notes)), []
    current = json.loads(config.to_json_best_effort())
    # Newest first over both tiers (`jaxpar.checkpoint.tiers`), the persistent one's step before the local one's.
    for step, directory in sorted([(s, ckpt_dir) for s in steps] + [(s, local) for s in local_steps], reverse=True):
        try:
            saved = saved_config(directory, step)
        except CheckpointError as e:
            notes.append(f"{e}; trying an older checkpoint")
            continue
        try:
            notes += compare_configs(saved, current, checkpoint=os.path.join(directory, str(step)))
            corpus_problem = _corpus_changed(config, directory, step)
        except CheckpointError as e:
            return None, [f"{e}; {_refusal_hint(directory, step, converted)}"]
        if corpus_problem:
            return None, [f"{corpus_problem}; {_refusal_hint(directory, step, converted)}"]
        if config.train.init_from_hf:
            notes.append(
                f"train.init_from_hf={config.train.init_from_hf} is ignored: this run resumes from checkpoint "
                f"{os.path.join(directory, str(step))}"
            )
        return WorkdirPlan(workdir, ckpt_dir, step, False, tuple(notes)), []
    if steps or local_steps:
        return None, [f"checkpoint.dir={ckpt_dir} holds checkpoints {steps} but none with a readable config; {OVERWRITE_HINT}"]
    if earlier:
        if _same_run_without_checkpoint(workdir, current):
            notes.append(
                f"--workdir={workdir} holds a run of this model and data that wrote no checkpoint: starting afresh; "
                f"it {replacing}"
            )
            return WorkdirPlan(workdir, ckpt_dir, None, True, tuple(notes)), []
        return None, [
            f"--workdir={workdir} holds an earlier run ({', '.join(earlier)}) but no complete checkpoint in {ckpt_dir} "
            f"to resume from; {OVERWRITE_HINT}"
        ]
    return WorkdirPlan(workdir, ckpt_dir, None, False, tuple(notes)), []


def _same_run_without_checkpoint(workdir: str, current: dict) -> bool:
    """Does WORKDIR/config.json describe the same model and data as `current` (a rerun of a run that
    failed or was killed before its first checkpoint)?"""
    try:
        with open(os.path.join(workdir, CONFIG_FILE)) as f:
            compare_configs(json.load(f), current, checkpoint=os.path.join(workdir, CONFIG_FILE))
    except (OSError, ValueError, CheckpointError):
        return False
    return True


def _refusal_hint(ckpt_dir: str, step: int, converted: tuple[int, str] | None) -> str:
    if converted is not None and converted[0] == step:
        return (
            f"it was converted from {converted[1]} by scripts/convert.py: train with the command convert.py printed "
            f"(the model of {converted[1]}, the config convert.py was given)"
        )
    return OVERWRITE_HINT


# The data-state keys that identify the corpus a checkpoint was saved reading.
CORPUS_TOKENS, CORPUS_FINGERPRINT = "corpus_tokens", "corpus_fingerprint"


def corpus_changed_problem(path: str, saved: dict, now: dict) -> str | None:
    """One line if a checkpoint's saved corpus identity (`saved`, its data state) differs from the
    corpus now (`now`: CORPUS_TOKENS and CORPUS_FINGERPRINT), else None. Keys a checkpoint lacks
    (older checkpoints, converted ones) are not compared."""
    tokens, fingerprint = saved.get(CORPUS_TOKENS), saved.get(CORPUS_FINGERPRINT)
    if tokens is not None and tokens != now[CORPUS_TOKENS]:
        change = f"a corpus of {tokens} tokens but the corpus now has {now[CORPUS_TOKENS]}"
    elif fingerprint is not None and fingerprint != now[CORPUS_FINGERPRINT]:
        change = f"a corpus of the same size ({now[CORPUS_TOKENS]} tokens) but other content (its sampled blocks differ)"
    else:
        return None
    return f"checkpoint {path} was saved reading {change}: its data position would point elsewhere; restore the corpus"


def corpus_identity(data_config) -> dict:
    return {CORPUS_TOKENS: corpus_tokens(data_config), CORPUS_FINGERPRINT: corpus_fingerprint(data_config)}


def _corpus_changed(config, ckpt_dir: str, step: int) -> str | None:
    """Same data config but another corpus (a token file rewritten, a folder grown)?"""
    saved = saved_data_state(ckpt_dir, step)
    try:
        now = corpus_identity(config.data)
    except (OSError, ValueError):
        return None  # the data preflight reports an unreadable corpus
    return corpus_changed_problem(os.path.join(ckpt_dir, str(step)), saved, now)


def busy_line(key: str, directory: str, holder: str) -> str:
    return f"{key}={directory} is in use by another run ({holder}); wait for it or choose another {key}"


def locks_checkpoint_dir(workdir: str, ckpt_dir: str) -> bool:
    """Whether a run locks its checkpoint directory besides its workdir: a local one other than the
    workdir itself (two runs of different workdirs may name one checkpoint.dir)."""
    return not is_remote(ckpt_dir) and os.path.abspath(ckpt_dir) != os.path.abspath(workdir)


class WorkdirLock:
    """`flock` on DIRECTORY/.lock for the lifetime of the run (see the module docstring): the workdir's,
    or the checkpoint directory's (`key` names it in messages)."""

    def __init__(self, workdir: str, key: str = "--workdir"):
        self.path, self.key = os.path.join(workdir, LOCK_FILE), key
        self._file = None
        self._made_workdir = False  # acquire created the workdir: release removes it if the run left it empty
        self.stale: str | None = None  # the previous holder, if the lock was left by a killed run

    def acquire(self) -> WorkdirLock:
        workdir = os.path.dirname(self.path)
        self._made_workdir = not os.path.isdir(workdir)
        while True:
            f = self._open(workdir)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = _describe_holder(f.read())
                f.close()
                self._remove_made_directory()
                raise WorkdirBusy(busy_line(self.key, os.path.dirname(self.path), holder)) from None
            if _names(self.path, f):
                break
            f.close()  # the run before removed the file between our open and our lock: lock the path's new file
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

    def _open(self, workdir: str):
        try:
            # The first write of a run: permission checks can pass where nothing can be created (as
            # root under /proc, on a read-only mount), so the OS's answer is the one reported.
            os.makedirs(workdir, exist_ok=True)
            return open(self.path, "a+")
        except OSError as e:
            raise WorkdirError(
                f"{self.key}={workdir}: cannot create its lock file {self.path} ({type(e).__name__}: {e.strerror or e}); "
                f"choose a writable directory"
            ) from None

    def release(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()  # should the removal fail: an empty lock file, nobody holds it, nothing stale
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still held (module docstring)
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None
        self._remove_made_directory()

    def _remove_made_directory(self) -> None:
        if self._made_workdir:
            with contextlib.suppress(OSError):  # only an empty directory: a run refused before writing anything
                os.rmdir(os.path.dirname(self.path))

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _names(path: str, f) -> bool:
    """Whether `path` still names the open file `f` (not removed or replaced since it was opened)."""
    try:
        here, held = os.stat(path), os.fstat(f.fileno())
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _replace_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
