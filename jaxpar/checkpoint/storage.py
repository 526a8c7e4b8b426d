"""Start-of-run checks that the checkpoint directory can be reached, written and is shared by all
processes.

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

import importlib.util
import os
import time
import uuid

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.checkpoint.errors import CheckpointError

TOKEN_PREFIX = ".shared-storage-check-"
# URL scheme -> (the fsspec package etils needs for it, the pyproject extra that installs it).
REMOTE_BACKENDS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}


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
    package, extra = REMOTE_BACKENDS[scheme]
    # etils prefers TensorFlow's gfile when TensorFlow is installed; found without importing it.
    if _importable(package) or importlib.util.find_spec("tensorflow") is not None:
        return None
    return f'{key}={directory} needs the {package} package: pip install -e ".[{extra}]" (or pip install {package})'


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
