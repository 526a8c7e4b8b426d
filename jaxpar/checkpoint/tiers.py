"""Two tiers of checkpoints: a frequent one on fast local storage, the persistent one on shared storage.

`checkpoint.local_dir` (a node-local disk, or a RAM disk such as /dev/shm) receives a checkpoint
every `checkpoint.local_every_steps` steps, keeping the newest `checkpoint.local_keep`; the
persistent tier (`checkpoint.dir`) keeps its own `every_steps` and the final save. A step due in
both goes to the persistent tier only. A restart resumes from the newest complete step in either
tier; an unreadable one is moved aside in its tier and the next newest, in either, is tried, so a
local tier that is damaged or gone (a replaced node) falls back to the persistent one. Everything
that reads checkpoints after the run (sampling, export, eval of a workdir) reads the persistent
tier only: the local one is a cache for restarts.

Both tiers are `Checkpoints` (Orbax CheckpointManagers), so the local directory must be one every
process of the run sees: one host's disk serves a single-host run with any number of processes.
Across hosts each process would write its own shards to its own disk and restore them there (or
from a peer): that is Orbax's emergency checkpointing (`orbax.checkpoint.experimental.emergency`),
which is built for multi-slice meshes, whose replicas restore each other's local checkpoints, and
is marked experimental; jaxpar does not use it yet (docs/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import orbax.checkpoint as ocp

from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.checkpoint.manager import Checkpoints, Restored


class Tiers:
    """The persistent tier, and the local one if configured, behind the interface the loop uses."""

    def __init__(self, persistent: Checkpoints, local: Checkpoints | None = None):
        self.persistent, self.local = persistent, local
        self.tiers = [t for t in (persistent, local) if t is not None]

    def _due(self, step: int, force: bool) -> Checkpoints | None:
        if self.persistent.should_save(step, force):
            return self.persistent
        if self.local is not None and self.local.should_save(step):
            return self.local
        return None

    def should_save(self, step: int, force: bool = False) -> bool:
        return self._due(step, force) is not None

    def save(self, step: int, state, *, data_state, config, force: bool = False) -> bool:
        tier = self._due(step, force)
        return tier is not None and tier.save(step, state, data_state=data_state, config=config, force=force)

    def wait(self) -> None:
        for tier in self.tiers:
            tier.wait()

    def close(self) -> None:
        errors = []
        for tier in self.tiers:
            try:
                tier.close()
            except CheckpointError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def latest_step(self) -> int | None:
        """The newest complete persistent checkpoint (what outlives the nodes)."""
        return self.persistent.latest_step()

    def path(self, step: int) -> str:
        """Where step `step` is: the persistent tier's if it holds it."""
        if self.local is not None and step not in self.persistent.all_steps() and step in self.local.all_steps():
            return self.local.path(step)
        return self.persistent.path(step)

    def restore(self, step: int | None, abstract_state) -> Restored:
        """The newest readable step of either tier (`step` given: that step, persistent first)."""
        if step is not None:
            tier = self.persistent if step in self.persistent.all_steps() or self.local is None else self.local
            return tier.restore(step, abstract_state)
        self.wait()
        # Newest first; the persistent tier (index 0) before the local one at the same step.
        candidates = sorted(((s, i) for i, tier in enumerate(self.tiers) for s in tier.all_steps()), key=lambda c: (-c[0], c[1]))
        if not candidates:
            raise CheckpointError(f"checkpoint.dir={self.persistent.directory} holds no complete checkpoint")
        notes = []
        for candidate, index in candidates:
            restored, message = self.tiers[index].try_step(candidate, abstract_state)
            if restored is not None:
                return dataclasses.replace(restored, notes=tuple(notes))
            notes.append(message)
        where = " or ".join(tier.directory for tier in self.tiers)
        raise CheckpointError(f"no readable checkpoint in {where}: " + " | ".join(notes))


def clear(directory: str) -> None:
    """Deletes the checkpoints (complete or not) a local tier holds, nothing else in `directory`."""
    if not os.path.isdir(directory):
        return
    names = [str(s) for s in ocp.path.step.checkpoint_steps(directory)] + list(ocp.path.step.tmp_checkpoints(directory))
    for name in names:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def local_dir(config) -> str:
    """checkpoint.local_dir as an absolute path ("" when the local tier is off)."""
    directory = str(config.checkpoint.local_dir)
    return os.path.abspath(directory) if directory else ""


def checks(config, checkpoint_dir: str) -> list[str]:
    """Bad local-tier settings, one line each naming the key."""
    section, errors = config.checkpoint, []
    directory, every = local_dir(config), int(section.local_every_steps)
    if every < 0:
        errors.append(f"checkpoint.local_every_steps={every} must be >= 0 (0: no local tier)")
    if int(section.local_keep) < 1:
        errors.append(f"checkpoint.local_keep={section.local_keep} must be >= 1")
    if every >= 0 and bool(directory) != (every > 0):
        errors.append("checkpoint.local_dir and checkpoint.local_every_steps go together: set both for a local tier, or "
                      f"neither (local_dir={str(section.local_dir)!r}, local_every_steps={every})")
    if directory and "://" in str(section.local_dir):
        errors.append(f"checkpoint.local_dir={section.local_dir} must be a local path (the shared tier is checkpoint.dir)")
    elif directory:
        persistent = os.path.abspath(checkpoint_dir) if "://" not in checkpoint_dir else checkpoint_dir
        inside = (directory + os.sep).startswith(persistent + os.sep) or (persistent + os.sep).startswith(directory + os.sep)
        if inside:
            errors.append(f"checkpoint.local_dir={directory} must lie outside checkpoint.dir={checkpoint_dir} and not hold it")
    return errors
