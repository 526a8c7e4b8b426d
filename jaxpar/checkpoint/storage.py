"""Start-of-run checks that the checkpoint directory can be reached, written and is shared by all
processes.

Before a checkpoint is written, `check_free_space` compares the free space of a local directory
with the state's size (an upper bound: the arrays are written zstd-compressed) and refuses in one
line naming the path and both numbers, instead of a write that fails half way.

A remote `checkpoint.dir` (gs://, s3://) is reached through etils.epath, which needs an optional
package per scheme (gcsfs, s3fs; or TensorFlow's gfile); `remote_problem` names the missing one and
the pip extra that installs it, instead of the ImportError a first listing would raise.

Every process of a multi-process run writes its own shards of each checkpoint into the same
directory, and process 0 alone finalizes it (an atomic rename), so a directory that is local to each
host would yield checkpoints that look complete on host 0 and miss the other hosts' shards. Checking
once at start turns that into a one-line error instead of an unrestorable checkpoint hours later.

Cross-process agreement uses two tiny collectives over all devices (`process_allgather`,
`broadcast_one_to_all`); every process reaches the same verdict and raises the same error, so no
process is left waiting in a collective the others never enter.
"""

from __future__ import annotations

import errno
import importlib
import os
import re
import shutil
import time
import uuid

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.extras import install_hint, installed

TOKEN_PREFIX = ".shared-storage-check-"
# URL scheme -> the fsspec package etils needs for it (`jaxpar.extras` names the pip extra that installs it).
REMOTE_BACKENDS = {"gs": "gcsfs", "s3": "s3fs"}


def is_remote(directory: str) -> bool:
    """gs://, s3:// and the like (paths Orbax reaches through etils.epath, not the local filesystem)."""
    return "://" in directory


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `directory` (or of its
    nearest existing parent, if it does not exist yet)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def state_bytes(state) -> int:
    """Bytes of a pytree of (global) arrays or ShapeDtypeStructs: what a checkpoint of it holds at most."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(state))


def space_problem(directory: str, needed: int, key: str = "checkpoint.dir") -> str | None:
    """One line if the (local) `directory` has less than `needed` bytes free, else None."""
    if is_remote(directory):
        return None
    free = free_bytes(directory)
    if free >= needed:
        return None
    return (
        f"{key}={directory} has {free} bytes ({_size(free)}) free but a checkpoint of this run needs about {needed} "
        f"bytes ({_size(needed)}, the state's size); free space there or set {key} to a larger disk"
    )


def check_free_space(directory: str, needed: int, key: str = "checkpoint.dir") -> None:
    """`space_problem` as a CheckpointError, agreed by every process (one refuses, all stop)."""
    problem = space_problem(directory, needed, key)
    if jax.process_count() > 1:
        short = [i for i, ok in enumerate(_all_processes(problem is None)) if not ok]
        if short and problem is None:
            problem = f"{key}={directory} is too full for the next checkpoint on process(es) {short} (see their error)"
    if problem is not None:
        raise CheckpointError(problem)


def _os_error(error: BaseException) -> int | None:
    """The errno of an OSError, or the one TensorStore quotes in its message ("[os_error_code='28']")."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    found = re.search(r"os_error_code='(\d+)'", str(error))
    return int(found.group(1)) if found else None


def write_failure(error: BaseException, directory: str, step, needed: int | None) -> str:
    """The one line for a checkpoint write that failed: the OS's reason first (a full disk says so,
    with the bytes free and needed), then the error's first line, shortened."""
    code = _os_error(error)
    text = (str(error).strip().splitlines() or [""])[0]
    text = text if len(text) <= 300 else text[:297] + "..."
    if code == errno.ENOSPC:
        free = "" if is_remote(directory) else f"{free_bytes(directory)} bytes free now"
        need = "" if needed is None else f", a checkpoint needs about {needed}"
        return (
            f"writing checkpoint step {step} in {directory} failed: the disk is full ({free}{need}); "
            f"free space there or set checkpoint.dir to a larger disk"
        )
    reason = f"{os.strerror(code)}: " if code else ""
    return f"writing checkpoints in {directory} failed at step {step} ({reason}{type(error).__name__}: {text})"


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def remote_problem(directory: str, key: str = "checkpoint.dir") -> str | None:
    """One line if `directory` is a remote URL whose filesystem package is not installed, else None."""
    scheme = directory.split("://", 1)[0] if "://" in directory else ""
    if scheme not in REMOTE_BACKENDS:
        return None
    package = REMOTE_BACKENDS[scheme]
    # etils prefers TensorFlow's gfile when TensorFlow is installed; found without importing it.
    if _importable(package) or installed("tensorflow"):
        return None
    return f"{key}={directory} needs the {package} package: {install_hint(package)}"


def _try_write(directory: str) -> str | None:
    """None if this process can create `directory` and write a file in it, else the OS error."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write-probe-{os.getpid()}-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def _all_processes(flag: bool) -> np.ndarray:
    """This flag from every process, indexed by process."""
    return np.asarray(multihost_utils.process_allgather(np.asarray([flag], np.int32), tiled=True)).astype(bool)


def _sees_token(path: str, token: str, wait_s: float) -> bool:
    # Network filesystems may show a new file to other hosts only after their attribute cache expires.
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path) as f:
                if f.read() == token:
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared_storage(directory: str, *, key: str = "checkpoint.dir", wait_s: float = 10.0) -> None:
    """Raises CheckpointError (one line, on every process) if `directory` is not writable by every
    process or, with several processes, if a file written by process 0 is not visible to all."""
    directory = os.path.abspath(directory)
    error = _try_write(directory)
    if jax.process_count() == 1:
        if error:
            raise CheckpointError(f"{key}={directory} is not writable ({error}); set {key} to a writable directory")
        return
    writable = _all_processes(error is None)
    if not writable.all():
        failing = [i for i, ok in enumerate(writable) if not ok]
        detail = f" ({error})" if error else ""
        raise CheckpointError(
            f"{key}={directory} is not writable by process(es) {failing}{detail}; "
            f"set {key} to a writable shared directory"
        )

    token = uuid.uuid4().hex if jax.process_index() == 0 else "0" * 32
    path = os.path.join(directory, TOKEN_PREFIX + token)
    if jax.process_index() == 0:
        with open(path, "w") as f:
            f.write(token)
    # The broadcast also orders process 0's write before everyone's read.
    token_bytes = multihost_utils.broadcast_one_to_all(np.frombuffer(token.encode(), np.uint8))
    token = np.asarray(token_bytes, np.uint8).tobytes().decode()
    path = os.path.join(directory, TOKEN_PREFIX + token)
    seen = _all_processes(_sees_token(path, token, wait_s))
    if jax.process_index() == 0:
        os.remove(path)
    if not seen.all():
        blind = [i for i, ok in enumerate(seen) if not ok]
        raise CheckpointError(
            f"{key}={directory} is not shared between processes (process {blind[0]} cannot see {path} written by "
            f"process 0{'' if len(blind) == 1 else f'; nor can processes {blind[1:]}'}); set {key} to storage every "
            f"process mounts at the same path"
        )
