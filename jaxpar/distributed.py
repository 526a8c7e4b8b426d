"""Joining a multi-process JAX run: `initialize()` before the first JAX computation.

Where the run's shape comes from, first match wins:
1. explicit arguments `initialize(coordinator, num_processes, process_id)`;
2. the environment: JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES,
   JAX_PROCESS_ID, as `scripts/launch_local.py` sets them (JAX reads only the first one itself);
3. a SLURM job step with more than one task: JAX detects coordinator, count and id itself.
Otherwise the run is single-process and nothing happens. The CPU device count of a process is JAX's
own `JAX_NUM_CPU_DEVICES` (with JAX_PLATFORMS=cpu), which launch_local also sets. Once joined, every
process watches the others (`jaxpar.peers`): a lost process ends the survivors within seconds, one
line each, exit code `peers.EXIT_PEER_LOST`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import jax

from jaxpar import peers

log = logging.getLogger(__name__)

COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
# The variables JAX's SLURM detection needs (jax._src.clusters.slurm_cluster).
SLURM_ENV = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


class DistributedError(ValueError):
    """An inconsistent multi-process setting; the message is one line naming it."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None


def _in_slurm_job_with_several_tasks() -> bool:
    return all(name in os.environ for name in SLURM_ENV) and (_env_int("SLURM_NTASKS") or 1) > 1


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> bool:
    """Calls `jax.distributed.initialize` if this process is part of a multi-process run (see the
    module docstring); returns whether it did (or had already)."""
    if jax.distributed.is_initialized():
        return True
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or None
    num_processes = num_processes if num_processes is not None else _env_int(NUM_PROCESSES_ENV)
    process_id = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [name for name, v in given.items() if v is None]
        if missing:
            env = {"coordinator": COORDINATOR_ENV, "num_processes": NUM_PROCESSES_ENV, "process_id": PROCESS_ID_ENV}
            raise DistributedError(
                f"multi-process setup is missing {', '.join(f'{m} ({env[m]})' for m in missing)}; "
                f"set all three of {COORDINATOR_ENV}, {NUM_PROCESSES_ENV}, {PROCESS_ID_ENV} or none"
            )
        if not 0 <= process_id < num_processes:
            raise DistributedError(f"{PROCESS_ID_ENV}={process_id} must be in [0, {NUM_PROCESSES_ENV}={num_processes})")
        log.info("jax.distributed: process %d of %d, coordinator %s", process_id, num_processes, coordinator)
        with _joining(f"joining a {num_processes}-process run (coordinator {coordinator})", process_id):
            jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
        peers.watch()
        return True
    if _in_slurm_job_with_several_tasks():
        log.info("jax.distributed: SLURM job step with %s tasks", os.environ["SLURM_NTASKS"])
        with _joining(f"joining the {os.environ['SLURM_NTASKS']} tasks of SLURM job {os.environ['SLURM_JOB_ID']}",
                      _env_int("SLURM_PROCID")):
            jax.distributed.initialize()
        peers.watch()
        return True
    return False


@contextlib.contextmanager
def _joining(label: str, process_id: int | None):
    """Said on process 0 with its time (as the training loop's start-up phases are): a process waits
    here until every other one has started, which on a cluster can take minutes."""
    said, started = process_id == 0, time.perf_counter()
    if said:
        print(f"{label} ...", end="", flush=True)
    try:
        yield
    finally:
        if said:
            print(f" {time.perf_counter() - started:.1f} s", flush=True)
