"""Goodput: where a run's wall time went, per start and over every restart of one workdir.

Each start of a run (an *attempt*) divides its wall time, from `train()` being called to its end,
into kinds (`KINDS`):
- productive: the train steps' execution (`step_s` of metrics.jsonl, the same numbers);
- compile: compiling the train and eval steps (with the fit check);
- input: opening the data, and waiting for a batch between steps;
- checkpoint: the time the run waited on a save (the copy to host of an async save, the waits);
- restore: reading the newest checkpoint;
- eval: evaluations;
- lost: steps trained after the checkpoint the next start resumed from — redone, so their time
  moves from productive to lost when that start reads the ledger;
- other: the rest (checks, building, initialising, logging), so the kinds sum to the wall time.
Between two attempts, `restart`: from the last sign of life of one to the start of the next
(the relaunch, its backoff, interpreter and JAX start-up before `train()`).

The start-up phases are timed where `StartupLog.phase` times them (`kind=`), the loop's by
`Ledger.timed`. The ledger is `WORKDIR/goodput.json`, rewritten atomically by process 0 after every
step and save and by a heartbeat thread every HEARTBEAT_S, so a start killed at any moment (kill -9)
leaves its accounting up to about a second before the kill: the phase it was in (`current`)
is charged up to the last heartbeat (a step that never finished: lost). Lost work is exact: every
save records how much productive time the attempt had trained up to that step (`marks`), and the
next start, resuming from checkpoint R, charges as lost each earlier attempt's productive time
after R. Nothing is written before the run is known to start (`open`); a start refused or stopped
earlier leaves no record and its time counts in the next start's `restart`.

The one-line summaries (`summary`) are printed at every restart and at the end; the end's
cumulative numbers are also a metrics.jsonl record (`record`), which trackers log.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

KINDS = ("productive", "compile", "input", "checkpoint", "restore", "eval", "lost", "other")
RESTART = "restart"  # between attempts (not a kind of an attempt's own time)
LEDGER_FILE = "goodput.json"
HEARTBEAT_S = 1.0
WRITTEN_AT_START = ("eval", "checkpoint")  # kinds whose start is written at once (a few per run, not per step)
MAX_MARKS = 64  # save marks kept per attempt (a fallback further back than these interpolates)
SNAPSHOT_S = 30.0  # between two points of an attempt's timeline (for scripts/goodput.py's plot)
MAX_SNAPSHOTS = 256  # per attempt; when full, every other one is dropped and the spacing doubles


def _now() -> float:
    return time.time()


class Ledger:
    """One attempt's time accounting; process 0's is written to WORKDIR/goodput.json once `open`ed."""

    def __init__(self, writer: bool = True):
        self.writer = writer
        self.started = _now()
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.trained = 0.0  # productive seconds including what a later start finds lost
        self.first_step = self.last_step = 0
        self.marks: dict[int, float] = {}
        self.current: str | None = None  # the kind being timed now (a kill charges it up to the heartbeat)
        self.current_since = 0.0
        self.earlier: list[dict] = []  # the attempts before this one, from the ledger
        self.lost_now: tuple[float, int, int] | None = None  # (seconds, first, last step) this start found lost
        self.snapshots: list[list[float]] = []
        self._snapshot_every = SNAPSHOT_S
        self.path: str | None = None
        self.opened = False  # the run started (`open`): an end is accounted
        self._lock, self._file_lock = threading.Lock(), threading.Lock()
        self._stack: list[list] = []  # the `timed` blocks open now, innermost last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ended: str | None = None

    # -- timing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def timed(self, kind: str):
        """Charges the block's time to `kind` (a block inside another is taken out of the outer one);
        yields a function giving the seconds since the block began (`StartupLog` prints them)."""
        frame = [kind, time.perf_counter(), 0.0]  # kind, start, seconds of blocks inside
        self._stack.append(frame)
        self.current, self.current_since = kind, _now()
        if kind in WRITTEN_AT_START:
            self._write()
        try:
            yield lambda: time.perf_counter() - frame[1]
        finally:
            elapsed = time.perf_counter() - frame[1]
            self._stack.pop()
            self.add(kind, elapsed - frame[2])
            if self._stack:
                self._stack[-1][2] += elapsed
            self.current, self.current_since = (self._stack[-1][0], _now()) if self._stack else (None, 0.0)

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.seconds[kind] += seconds

    def begin_step(self) -> None:
        """The step's execution starts (killed before `step`: its time is lost)."""
        self.current, self.current_since = "productive", _now()

    def step(self, step: int, seconds: float) -> None:
        """Step `step` ran in `seconds` (its `step_s`)."""
        with self._lock:
            self.seconds["productive"] += seconds
            self.trained += seconds
            self.last_step = step
            self.current = None
        self._write()

    def mark(self, step: int) -> None:
        """A checkpoint of step `step` was started: what the attempt had trained by then."""
        with self._lock:
            self.marks[step] = self.trained
            while len(self.marks) > MAX_MARKS:
                del self.marks[min(self.marks)]
        self._write()

    # -- the ledger file --------------------------------------------------------------------

    def read_earlier(self, workdir: str) -> None:
        """The earlier attempts of this run (before anything is moved aside); reads only."""
        self.earlier = [a for a in read(workdir) if isinstance(a, dict) and "started" in a]

    def open(self, workdir: str, resume_step: int | None, first_step: int) -> None:
        """The run starts at step `first_step` (from checkpoint `resume_step`, None: from scratch):
        charges the earlier attempts' work after it as lost, then writes from now on."""
        self.first_step = self.last_step = first_step
        self.opened = True
        if self.earlier:
            self.lost_now = charge_lost(self.earlier, resume_step or 0)
        self.path = os.path.join(workdir, LEDGER_FILE) if self.writer else None
        self._snapshot()
        self._write()
        if self.path is not None:
            self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="jaxpar-goodput")
            self._thread.start()

    def close(self, ended: str) -> None:
        self.ended = ended
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.current = None
        self._snapshot()
        self._write()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.snapshots and self.wall() - self.snapshots[-1][0] >= self._snapshot_every:
                self._snapshot()
            self._write()

    def wall(self) -> float:
        return _now() - self.started

    def _snapshot(self) -> None:
        """A point of the attempt's timeline: [seconds since its start, then each kind's seconds]."""
        with self._lock:
            self.snapshots.append([self.wall(), *self._kinds(_now()).values()])
            if len(self.snapshots) > MAX_SNAPSHOTS:
                self.snapshots = self.snapshots[::2]
                self._snapshot_every *= 2

    def _kinds(self, now: float) -> dict:
        """This attempt's seconds by kind at `now`, other making up the wall time."""
        kinds = dict(self.seconds)
        kinds["other"] = 0.0
        kinds["other"] = max(0.0, (now - self.started) - sum(kinds.values()))
        return kinds

    def attempt(self) -> dict:
        """This attempt as the ledger stores it."""
        now = _now()
        return {
            "started": self.started, "updated": now, "ended": self.ended, "first_step": self.first_step,
            "last_step": self.last_step, "trained_s": self.trained, "seconds": {k: v for k, v in self.seconds.items() if k != "other"},
            "marks": {str(k): v for k, v in self.marks.items()}, "current": self.current,
            "current_since": self.current_since if self.current else None, "snapshots": [list(p) for p in self.snapshots],
        }

    def attempts(self) -> list[dict]:
        with self._lock:
            return [*self.earlier, self.attempt()]

    def _write(self) -> None:
        if self.path is None:
            return
        with self._file_lock:  # the heartbeat thread and the loop: one writer at a time
            attempts = self.attempts()
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"attempts": attempts}, f)
            os.replace(tmp, self.path)


def read(workdir: str) -> list[dict]:
    """The attempts of WORKDIR/goodput.json (none if absent or unreadable)."""
    try:
        with open(os.path.join(workdir, LEDGER_FILE)) as f:
            attempts = json.load(f).get("attempts", [])
    except (OSError, ValueError, AttributeError):
        return []
    return attempts if isinstance(attempts, list) else []


def _kept(attempt: dict, resume_step: int) -> float:
    """The productive seconds of `attempt` up to the end of step `resume_step`."""
    first, last, trained = attempt["first_step"], attempt["last_step"], attempt["trained_s"]
    if resume_step >= last:
        return trained
    if resume_step <= first:
        return 0.0
    marks = attempt.get("marks", {})
    if str(resume_step) in marks:
        return float(marks[str(resume_step)])
    return trained * (resume_step - first) / (last - first)  # a mark dropped (MAX_MARKS): by steps


def charge_lost(attempts: list[dict], resume_step: int) -> tuple[float, int, int] | None:
    """Moves each attempt's productive time after step `resume_step` to lost (in place; never
    twice: lost is the most any restart found), and notes a step a kill interrupted (`account`
    charges it as lost). Returns (seconds newly lost, first and last lost step), or None."""
    newly, last_lost = 0.0, resume_step
    for a in attempts:
        seconds = a["seconds"]
        if _crashed_in(a) == "productive" and not a.get("in_flight_charged"):
            a["in_flight_charged"] = True
            newly += a["updated"] - a["current_since"]
            last_lost = max(last_lost, a["last_step"] + 1)
        lost = a["trained_s"] - _kept(a, resume_step)
        if lost > seconds.get("lost", 0.0):
            newly += lost - seconds.get("lost", 0.0)
            seconds["lost"] = lost
            seconds["productive"] = a["trained_s"] - lost
            last_lost = max(last_lost, a["last_step"])
    return (newly, resume_step + 1, last_lost) if newly > 0 else None


def _crashed_in(attempt: dict) -> str | None:
    """The kind an attempt that never ended was in at its last heartbeat."""
    return None if attempt.get("ended") or not attempt.get("current_since") else attempt.get("current")


def account(attempt: dict) -> dict:
    """An attempt's seconds by kind (KINDS), summing to its wall time (start to last update); a
    crashed attempt's phase in flight charged to its kind (a step that never finished: lost)."""
    kinds = {k: float(attempt["seconds"].get(k, 0.0)) for k in KINDS}
    crashed = _crashed_in(attempt)
    if crashed is not None:
        kinds["lost" if crashed == "productive" else crashed] += attempt["updated"] - attempt["current_since"]
    wall = attempt["updated"] - attempt["started"]
    kinds["other"] = 0.0
    kinds["other"] = max(0.0, wall - sum(kinds.values()))
    return kinds


def totals(attempts: list[dict]) -> dict:
    """Seconds by kind over every attempt, `restart` (the gaps between them) and `wall` (first
    start to last update, their sum)."""
    out = dict.fromkeys((*KINDS, RESTART), 0.0)
    for i, a in enumerate(attempts):
        for kind, seconds in account(a).items():
            out[kind] += seconds
        if i:
            out[RESTART] += max(0.0, a["started"] - attempts[i - 1]["updated"])
    out["wall"] = sum(out[k] for k in (*KINDS, RESTART))
    return out


def _fraction(kinds: dict) -> float:
    wall = kinds.get("wall", sum(kinds.values()))
    return kinds["productive"] / wall if wall > 0 else 0.0


def describe(kinds: dict) -> str:
    """"83.1% of 12.4 s productive (compile 1.2 s, ...)": the kinds that took any time."""
    wall = kinds.get("wall", sum(kinds.values()))
    parts = [f"{k} {kinds[k]:.1f} s" for k in (*KINDS, RESTART) if k in kinds and k != "productive" and kinds[k] >= 0.05]
    rest = f" ({', '.join(parts)})" if parts else ""
    share = 100 * _fraction({**kinds, "wall": wall})
    return f"{share:.1f}% of {wall:.1f} s trained the model: productive {kinds['productive']:.1f} s{rest}"


def summary(attempts: list[dict]) -> list[str]:
    """The end's lines: this start (the last attempt), and (after restarts) the whole run."""
    lines = [f"goodput of this start: {describe(account(attempts[-1]))}"]
    if len(attempts) > 1:
        lines.append(f"goodput over {len(attempts)} starts: {describe(totals(attempts))}")
    return lines


def restart_summary(ledger: Ledger) -> list[str]:
    """A restart's lines: what the earlier starts cost, and what the fault before this one lost."""
    if not ledger.earlier:
        return []
    earlier = totals(ledger.earlier)
    lines = [f"goodput of the {len(ledger.earlier)} earlier start{'s' * (len(ledger.earlier) > 1)}: {describe(earlier)}"]
    if ledger.lost_now is not None:
        seconds, first, last = ledger.lost_now
        steps = f"steps {first}-{last}" if last > first else f"step {first}" if last == first else "a step in flight"
        lines.append(f"goodput: the fault before this start lost {seconds:.1f} s of training ({steps}, after the checkpoint "
                     f"this start resumes from)")
    return lines


def record(attempts: list[dict], step: int) -> dict:
    """The metrics.jsonl record of the whole run's goodput at its end (every start so far)."""
    kinds = totals(attempts)
    return {"step": int(step), "goodput": _fraction(kinds), "goodput_wall_s": kinds["wall"],
            **{f"goodput_{k}_s": kinds[k] for k in (*KINDS, RESTART)}, "goodput_starts": len(attempts)}
