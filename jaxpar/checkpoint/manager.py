"""Checkpoints of a training run on (shared) storage, over Orbax's CheckpointManager.

One checkpoint per saved step `S`, in `<dir>/S/`, holds four Orbax items:
- `state`: the TrainState pytree (step, params, optimizer state, loss-scale arrays) via StandardSave:
  every process writes the shards it owns (OCDBT + zarr), nothing is gathered on one host;
- `data`: the data iterator's state (JSON; for `BatchIterator` that is {"step": k});
- `config`: the run's config (JSON), compared with the resuming run's by `compare_configs`;
- `integrity`: per-leaf content fingerprints (see `integrity.py`), checked on restore.
There is no separate RNG state: parameter init is a function of `train.seed`, the data order a pure
function of (seed, step), and the training step draws no randomness, so the saved step is all of it.
Static (non-array) pytree fields such as `LossScale.dynamic/period` are not saved; a restore takes
them from the abstract state it is given.

Completeness follows Orbax: a save is written to `<dir>/S.orbax-checkpoint-tmp/` and renamed to
`<dir>/S/` by process 0 only after every process has committed, so an interrupted save (crash,
kill -9) leaves a `*.orbax-checkpoint-tmp` directory that is never listed as a step. Opening a
`Checkpoints` reports such directories (and, unless read-only, removes them). A complete checkpoint
whose files were later damaged (missing, truncated, flipped bits) fails its restore with a one-line
reason; `restore(None, ...)` then moves it aside to `<dir>/S.unreadable` and falls back to the next
older one, so the run loses at most the steps since that one.

Multi-process: every process calls every method (Orbax synchronizes internally). Restore failures
are caught inside the Orbax item handlers, before Orbax's post-restore barrier, and the verdict is
agreed by a tiny all-gather, so every process falls back together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jaxpar.checkpoint.config_check import as_dict
from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.checkpoint.integrity import fingerprints, leaf_names, mismatches
from jaxpar.checkpoint.quiet import NOISE, OVERRIDE_NOTICES, notices_dropped, read_only_notices_dropped
from jaxpar.checkpoint.storage import check_free_space, is_remote, state_bytes, write_failure

log = logging.getLogger(__name__)

STATE, DATA, CONFIG, INTEGRITY = "state", "data_iterator", "config", "integrity"
UNREADABLE_SUFFIX = ".unreadable"


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any  # the abstract state's pytree, every leaf a jax.Array on the abstract leaf's sharding
    data_state: dict
    config: dict
    path: str
    notes: tuple[str, ...]  # one line per newer checkpoint that was unreadable and skipped


@dataclasses.dataclass(frozen=True)
class _Unreadable:
    """What a tolerant handler returns instead of raising (see `_tolerant`)."""

    reason: str


def _one_line(error: BaseException, limit: int = 300) -> str:
    # TensorStore errors arrive wrapped; the innermost cause says what is wrong with which file.
    while error.__cause__ is not None:
        error = error.__cause__
    text = (str(error).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


def _tolerant(handler_class):
    """A subclass of an Orbax handler whose restore returns `_Unreadable` instead of raising.

    Orbax's Checkpointer runs a cross-process barrier after the handlers' restore; a process that
    raised before it would leave the others waiting there. Catching inside the handler lets every
    process reach the barrier; the verdicts are combined afterwards.
    """

    class Tolerant(handler_class):
        def restore(self, directory, args=None):
            try:
                return super().restore(directory, args=args)
            except Exception as e:  # noqa: BLE001 - any read failure makes the checkpoint unreadable
                return _Unreadable(_one_line(e))

    Tolerant.__name__ = Tolerant.__qualname__ = f"Tolerant{handler_class.__name__}"
    return Tolerant


_TolerantStandard = _tolerant(ocp.StandardCheckpointHandler)
_TolerantJson = _tolerant(ocp.JsonCheckpointHandler)


@functools.cache  # once per process: the handler is Orbax's global one
def _save_replicas_whole_on_one_process() -> None:
    """On one process every replica of an array is in this host's memory, so Orbax's replica-parallel
    save (its default but on GPU) writes the same bytes as saving one replica whole, only after slicing
    each replicated array per device, an eagerly compiled slice per shape (the tiny Mixtral on 8 CPU
    devices: a 2.7-3.0 s final save, 0.6-0.9 s whole). Several processes keep Orbax's default, which
    splits a replicated array's write among the hosts. Orbax offers the option only on its handler
    for jax.Array, so this registers Orbax's default one with that option changed."""
    if jax.process_count() > 1:
        return
    from orbax.checkpoint._src.metadata.array_metadata_store import Store

    handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=Store())
    with notices_dropped(OVERRIDE_NOTICES):
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = _TolerantStandard()
    registry.add(STATE, ocp.args.StandardSave, state)
    registry.add(STATE, ocp.args.StandardRestore, state)
    for item in (DATA, CONFIG, INTEGRITY):
        json_handler = _TolerantJson()
        registry.add(item, ocp.args.JsonSave, json_handler)
        registry.add(item, ocp.args.JsonRestore, json_handler)
    return registry


def abstract_state(shapes, shardings):
    """The restore target: `shapes` (e.g. `jax.eval_shape(program.init)`) with each leaf's sharding
    from `shardings` (e.g. `program.state_shardings`, possibly of another mesh than the saving run's)."""
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes, shardings
    )


def _check_global_arrays(state) -> None:
    multi = jax.process_count() > 1
    for name, leaf in zip(leaf_names(state), jax.tree.leaves(state)):
        if not isinstance(leaf, jax.Array):
            raise CheckpointError(
                f"checkpoint: state leaf {name} is a {type(leaf).__name__}, not a jax.Array; put it on the mesh"
            )
        if multi and leaf.is_fully_addressable:
            # Orbax fails on these in multi-process saves ("Cannot serialize host local jax.Array").
            raise CheckpointError(
                f"checkpoint: state leaf {name} lives on this process only (sharding {leaf.sharding}); "
                f"a multi-process save needs global arrays, e.g. replicated over the mesh"
            )


def _agree(ok: bool) -> bool:
    """True iff `ok` on every process."""
    if jax.process_count() == 1:
        return ok
    flags = multihost_utils.process_allgather(np.asarray([ok], np.int32), tiled=True)
    return bool(np.asarray(flags).all())


class Checkpoints:
    """Saves and restores a run's checkpoints in `directory` (shared by all processes).

    `every_steps`: `save` writes when `step % every_steps == 0` (0: only forced saves).
    `keep`: how many of the newest complete checkpoints survive (None: all).
    `async_save`: `save` returns once the arrays are copied to host memory; files are written in
    the background (call `wait()` before reading them, `close()` at the end).
    `read_only`: never saves, removes or renames anything (for evaluation next to a live run).
    `verify`: fingerprint the state on save and check it on restore.
    """

    def __init__(
        self,
        directory: str,
        *,
        every_steps: int,
        keep: int | None = 3,
        async_save: bool = True,
        read_only: bool = False,
        verify: bool = True,
    ):
        if every_steps < 0:
            raise CheckpointError(f"checkpoint.every_steps={every_steps} must be >= 0 (0: only the final save)")
        if keep is not None and keep < 1:
            raise CheckpointError(f"checkpoint.keep={keep} must be >= 1 (or None to keep every checkpoint)")
        # Orbax needs an absolute path: a relative one fails only later, in the background commit thread.
        self.directory = directory if is_remote(directory) else os.path.abspath(directory)
        self.every_steps, self.keep, self.read_only, self.verify = int(every_steps), keep, read_only, verify
        if read_only and not epath.Path(self.directory).is_dir():
            raise CheckpointError(f"checkpoint.dir={self.directory} does not exist")
        self.incomplete = self._find_incomplete()
        removal = "" if read_only else "; Orbax removes it in the background"
        self.notes: list[str] = [
            f"ignored incomplete checkpoint {path} (a save that never finished){removal}" for path in self.incomplete
        ]
        for note in self.notes:
            self._warn(note)
        with read_only_notices_dropped() if read_only else contextlib.nullcontext():  # a reader is read-only by design
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=async_save,
                preservation_policy=None if keep is None else ocp.checkpoint_managers.LatestN(n=keep),
                cleanup_tmp_directories=not read_only,
                read_only=read_only,
                create=not read_only,
            )
            _save_replicas_whole_on_one_process()
            self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_handler_registry())
        self._pending: int | None = None  # the step of the last async save, until known finished
        self.needed_bytes: int | None = None  # the size of the last state saved (the next save's estimate)
        NOISE.open()
        self._open = True

    # -- listing ---------------------------------------------------------------------------

    def _find_incomplete(self) -> tuple[str, ...]:
        if not epath.Path(self.directory).is_dir():
            return ()
        names = ocp.path.step.tmp_checkpoints(self.directory)
        return tuple(
            os.path.join(self.directory, name) for name in sorted(names, key=ocp.path.step.step_from_checkpoint_name)
        )

    def path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (an in-flight async save is not one yet)."""
        steps = sorted(self._manager.all_steps())
        if self._pending is not None:
            if self._manager.is_saving_in_progress():
                steps = [s for s in steps if s != self._pending]  # Orbax lists it before finalizing
            else:
                self._pending = None
        return steps

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- saving ----------------------------------------------------------------------------

    def should_save(self, step: int, force: bool = False) -> bool:
        if self.read_only or step in self._manager.all_steps():
            return False  # Orbax never overwrites a step
        return force or (self.every_steps > 0 and step % self.every_steps == 0)

    def save(self, step: int, state, *, data_state: Mapping, config: str | Mapping, force: bool = False) -> bool:
        """Saves `state` (a pytree of global jax.Arrays) as step `step` if due (or `force`); returns
        whether it did. Asynchronous: the state may be donated or changed once this returns."""
        if not self.should_save(step, force):
            return False
        _check_global_arrays(state)
        self.needed_bytes = state_bytes(state)
        check_free_space(self.directory, self.needed_bytes)
        items = {
            STATE: ocp.args.StandardSave(state),
            DATA: ocp.args.JsonSave(dict(data_state)),
            CONFIG: ocp.args.JsonSave(as_dict(config)),
        }
        if self.verify:
            items[INTEGRITY] = ocp.args.JsonSave({"fingerprints": fingerprints(state)})
        with self._writing(step if self._pending is None else self._pending):  # an earlier async save may fail here
            saved = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        if saved:
            self._pending = step
        return saved

    @contextlib.contextmanager
    def _writing(self, step):
        """Any failure of a (background) write becomes one CheckpointError line naming the directory
        and step (a full disk says so, with the numbers); Orbax's own reports of it are dropped."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - Orbax / TensorStore / OS errors alike
            NOISE.take_first_error(failed=True)
            raise CheckpointError(write_failure(e, self.directory, step, self.needed_bytes)) from None

    def wait(self) -> None:
        """Blocks until every started save is complete on storage."""
        with self._writing(self._pending):
            self._manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        try:
            with self._writing(self._pending):
                self._manager.close()
        finally:
            self._pending = None
            if self._open:
                self._open = False
                NOISE.close()
                if (error := NOISE.take_first_error()) is not None:
                    self._warn(f"Orbax reported an error in the background: {error}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- restoring -------------------------------------------------------------------------

    def restore(self, step: int | None, abstract_state) -> Restored:
        """Step `step` (None: the newest readable one) restored onto the shardings of
        `abstract_state` (a pytree of ShapeDtypeStructs with `sharding=`, any mesh): each process
        reads only the shards its devices hold.

        An unreadable checkpoint raises CheckpointError naming it when `step` is given; with
        `step=None` it is reported in `Restored.notes`, moved aside (unless read-only) and the next
        older one is tried."""
        self.wait()
        candidates = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not candidates:
            raise CheckpointError(f"checkpoint.dir={self.directory} holds no complete checkpoint")
        if step is not None and step not in self.all_steps():
            raise CheckpointError(f"checkpoint {self.path(step)} does not exist (complete steps: {self.all_steps()})")
        notes = []
        for candidate in candidates:
            restored, message = self.try_step(candidate, abstract_state, set_aside=step is None)
            if restored is not None:
                return dataclasses.replace(restored, notes=tuple(notes))
            if step is not None:
                raise CheckpointError(message)
            notes.append(message)
        raise CheckpointError(f"no readable checkpoint in checkpoint.dir={self.directory}: " + " | ".join(notes))

    def try_step(self, step: int, abstract_state, *, set_aside: bool = True) -> tuple[Restored | None, str]:
        """(Restored, "") for a readable step, else (None, one line naming it and why); an unreadable
        one is moved aside (unless read-only or `set_aside` is False) and reported."""
        restored, reason = self._try_restore(step, abstract_state)
        if restored is not None:
            return restored, ""
        message = f"checkpoint {self.path(step)} is unreadable ({reason})"
        if set_aside and not self.read_only:
            message += f"; moved it to {self._quarantine(step)}"
        if set_aside:
            self._warn(message)
        return None, message

    def _try_restore(self, step: int, abstract_state) -> tuple[Restored | None, str]:
        path = self.path(step)
        has_integrity = (epath.Path(path) / INTEGRITY).is_dir()
        items = {
            STATE: ocp.args.StandardRestore(abstract_state),
            DATA: ocp.args.JsonRestore(),
            CONFIG: ocp.args.JsonRestore(),
        }
        if has_integrity:
            items[INTEGRITY] = ocp.args.JsonRestore()
        reason = ""
        try:
            result = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - e.g. an item directory missing (same on every process)
            result, reason = None, _one_line(e)
        if result is not None:
            reason = "; ".join(
                f"{item}: {result[item].reason}" for item in items if isinstance(result[item], _Unreadable)
            )
        if not _agree(not reason):
            return None, reason or "unreadable on another process"
        if has_integrity and self.verify:
            # A collective over all processes; its replicated result gives every process the same verdict.
            bad = mismatches(result[INTEGRITY]["fingerprints"], fingerprints(result[STATE]))
            if bad:
                return (
                    None,
                    f"content differs from its saved fingerprints in {len(bad)} leaves, e.g. {', '.join(bad[:3])}",
                )
        restored = Restored(
            step=step, state=result[STATE], data_state=result[DATA], config=result[CONFIG], path=path, notes=()
        )
        return restored, ""

    def _quarantine(self, step: int) -> str:
        """Renames an unreadable checkpoint out of Orbax's sight (kept for inspection) and returns the new path."""
        target = self.path(step) + UNREADABLE_SUFFIX
        if epath.Path(target).exists():
            target += f"-{int(time.time())}"
        if jax.process_index() == 0:
            epath.Path(self.path(step)).rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxpar-checkpoint-quarantine-{step}")
        self._manager.reload()
        return target

    @staticmethod
    def _warn(message: str) -> None:
        if jax.process_index() == 0:
            log.warning(message)
