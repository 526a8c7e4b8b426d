"""What `--overwrite` does with the earlier run: moves it aside, and lets go only once the new run
has proven itself.

When the new run is known to start (checked, built, compiled), `set_aside` moves the earlier run's
files — metrics.jsonl, config.json, tensorboard/, profile/ and every checkpoint step directory —
into `WORKDIR/previous-<time>/` (its checkpoints into `previous-<time>/checkpoints/`; with a
`checkpoint.dir` outside the workdir, into `CHECKPOINT_DIR/previous-<time>/`). Renames on one
filesystem: nothing is copied, nothing deleted. Then:
- the new run's first complete checkpoint: `let_go` deletes the moved files;
- the new run fails before that (out of memory, a bad shard, a crash): `restore` removes what the
  new run wrote and moves the earlier run back, so the workdir is as it was before the command;
- the process is killed before either: the earlier run stays in `previous-<time>/`, which every
  later start names (`leftovers`) until it is moved back or deleted.
Only process 0 of a multi-process run touches the workdir.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from etils import epath

from jaxpar.checkpoint.storage import is_remote

PREFIX = "previous-"


def _is_step_entry(name: str) -> bool:
    """What Orbax and jaxpar put in a checkpoint directory: `S`, `S.orbax-checkpoint-tmp*`, `S.unreadable*`."""
    return name.split(".")[0].isdigit()


def _inside(path: str, directory: str) -> bool:
    return not is_remote(path) and os.path.abspath(path).startswith(os.path.abspath(directory) + os.sep)


def _remove(path: epath.Path) -> None:
    if path.is_dir():
        path.rmtree()
    elif path.exists():
        path.unlink()


@dataclass
class Aside:
    """An earlier run moved aside: (original, moved) paths, and the folders created to hold them."""

    workdir: str
    checkpoint_dir: str
    run_files: tuple[str, ...]  # names of a run's files and folders in its workdir
    moved: list[tuple[str, str]] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return " and ".join(self.folders)

    def let_go(self) -> None:
        for folder in self.folders:
            _remove(epath.Path(folder))
        self.moved, self.folders = [], []

    def restore(self) -> None:
        """Removes what the new run wrote in the earlier run's places and moves the earlier run back."""
        workdir, ckpt = epath.Path(self.workdir), epath.Path(self.checkpoint_dir)
        for name in self.run_files:
            _remove(workdir / name)
        if ckpt.exists():
            for child in ckpt.iterdir():
                if _is_step_entry(child.name):
                    _remove(child)
        for original, moved in self.moved:
            epath.Path(moved).rename(original)
        self.let_go()


def set_aside(workdir: str, checkpoint_dir: str, run_files: tuple[str, ...]) -> Aside | None:
    """Moves the earlier run in `workdir` (its `run_files`) and `checkpoint_dir` aside (module
    docstring); None if there was nothing to move."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    holder = epath.Path(workdir) / f"{PREFIX}{stamp}"
    while holder.exists():  # a second --overwrite within the same second
        stamp += "x"
        holder = epath.Path(workdir) / f"{PREFIX}{stamp}"
    found = [name for name in run_files if (epath.Path(workdir) / name).exists()]
    ckpt = epath.Path(checkpoint_dir)
    steps = sorted(child.name for child in ckpt.iterdir() if _is_step_entry(child.name)) if ckpt.exists() else []
    if not found and not steps:
        return None
    aside = Aside(workdir, checkpoint_dir, tuple(run_files))
    holder.mkdir(parents=True)
    aside.folders.append(str(holder))
    aside.moved += [(str(epath.Path(workdir) / name), str(holder / name)) for name in found]
    if steps:
        if _inside(checkpoint_dir, workdir):
            step_holder = holder / "checkpoints"
        else:
            step_holder = ckpt / f"{PREFIX}{stamp}"
            aside.folders.append(str(step_holder))
        step_holder.mkdir(parents=True, exist_ok=True)
        aside.moved += [(str(ckpt / name), str(step_holder / name)) for name in steps]
    for original, moved in aside.moved:
        epath.Path(original).rename(moved)
    return aside


def leftovers(workdir: str, checkpoint_dir: str) -> list[str]:
    """`previous-*` folders an --overwrite left because its process was killed before it could decide."""
    found = []
    for directory in dict.fromkeys([workdir, checkpoint_dir]):
        path = epath.Path(directory)
        if path.is_dir():
            found += sorted(str(child) for child in path.iterdir() if child.name.startswith(PREFIX) and child.is_dir())
    return found
