"""Start-up steps every process of a run takes together: one preflight verdict, the locks.

`run_preflight` runs `preflight.check_run` on every process and stops all of them if any refused;
in a multi-process run everyone then follows process 0's decisions about the workdir (it alone
inspected it). `lock` takes process 0's locks of the workdir and a local checkpoint directory,
`unlock` releases them. `memory_report` is the start-up line of the state's size per device.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.train import preflight
from jaxpar.train import workdir as workdirs
from jaxpar.train.progress import StartupLog
from jaxpar.train.setup import bytes_per_device


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024


def memory_report(program) -> str:
    abstract = jax.eval_shape(program.init)
    shard = program.state_shardings
    params = bytes_per_device(abstract.params, shard.params)
    opt = bytes_per_device(abstract.opt_state, shard.opt_state)
    report = f"per device: params {_human(params)}, optimizer state {_human(opt)}"
    if abstract.reference is not None:  # train.objective dpo without LoRA: the frozen reference model
        report += f", DPO reference {_human(bytes_per_device(abstract.reference, shard.reference))}"
    return report


def _agree(ok: bool) -> list[int]:
    """Indices of the processes where `ok` is False (every process gets the same list)."""
    if jax.process_count() == 1:
        return [] if ok else [0]
    flags = np.asarray(multihost_utils.process_allgather(np.asarray([ok], np.int32), tiled=True))
    return [i for i, flag in enumerate(flags) if not flag]


def run_preflight(config, workdir: str, devices, overwrite: bool) -> preflight.Preflight:
    """check_run on every process (only process 0 decides about the workdir, which only it writes),
    then one verdict for all: a process whose own checks passed still stops if another's failed."""
    error = None
    try:
        run = preflight.check_run(
            config, workdir, len(devices), devices[0].platform, overwrite=overwrite, owns_workdir=jax.process_index() == 0
        )
    except preflight.ConfigError as e:
        error, run = e, None
    failed = _agree(error is None)
    if error is not None:
        raise error
    if failed:
        raise preflight.ConfigError(f"process(es) {failed} refused the run; see their errors")
    if jax.process_count() > 1:  # everyone follows process 0's decisions (it alone inspected the workdir)
        plan = run.workdir
        step = -1 if plan.resume_step is None else plan.resume_step
        step, overwrite = (int(x) for x in multihost_utils.broadcast_one_to_all(np.asarray([step, plan.overwrite], np.int64)))
        run = dataclasses.replace(run, workdir=dataclasses.replace(plan, resume_step=None if step < 0 else step, overwrite=bool(overwrite)))
    return run


def lock(workdir: str, checkpoint_dir: str, startup: StartupLog, local_dir: str = "") -> list[workdirs.WorkdirLock]:
    """Process 0 locks the workdir, then a local checkpoint directory (another run's workdir may name
    it) and the local tier's (`jaxpar.checkpoint.tiers`); released in reverse order by `unlock`."""
    locks, error = [], None
    if jax.process_index() == 0:
        targets = [(workdir, "--workdir")]
        if workdirs.locks_checkpoint_dir(workdir, checkpoint_dir):
            targets.append((checkpoint_dir, "checkpoint.dir"))
        if local_dir:
            targets.append((local_dir, "checkpoint.local_dir"))
        try:
            for directory, key in targets:
                locks.append(workdirs.WorkdirLock(directory, key).acquire())
        except workdirs.WorkdirError as e:
            error = e
            unlock(locks)
    failed = _agree(error is None)
    if error is not None:
        raise error
    if failed:
        raise workdirs.WorkdirError(f"--workdir={workdir} could not be locked by process 0 (see its error)")
    for lock in locks:
        if lock.stale:
            where = os.path.dirname(lock.path)
            startup.say(f"took over the lock of {where} left by a run that ended without releasing it ({lock.stale})")
    return locks


def unlock(locks: list[workdirs.WorkdirLock]) -> None:
    for lock in reversed(locks):  # the checkpoint directory first: inside the workdir, it is removed first if empty
        lock.release()
