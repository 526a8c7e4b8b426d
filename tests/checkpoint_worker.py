"""Subprocess side of tests/test_checkpoint.py and tests/test_distributed.py.

python tests/checkpoint_worker.py kill_mid_save DIR
    saves step 1 (waits for it), starts an async save of step 2 and SIGKILLs itself as soon as
    save() returns, i.e. while the background commit is still writing.
python tests/checkpoint_worker.py save_multiprocess DIR OUT.npz     (under scripts/launch_local.py)
    checks DIR is shared, builds the tiny TrainState on all processes' devices, saves it as step 3
    and (process 0) writes the state gathered from all processes to OUT.npz as the reference.
python tests/checkpoint_worker.py shared_check DIR_PREFIX          (under scripts/launch_local.py)
    runs check_shared_storage on DIR_PREFIX + process index: must fail with its one-line error.
"""

import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import distributed


def kill_state(scale: int):
    # 64 MiB of incompressible values: the background commit takes far longer than the kill. numpy
    # draws them, so they do not depend on XLA's compile options (tests use LLVM opt level 0).
    return {
        f"w{i}": jnp.asarray(np.random.default_rng(i).standard_normal((1024, 4096), np.float32) * scale)
        for i in range(4)
    }


def kill_mid_save(directory: str) -> None:
    from jaxpar.checkpoint import Checkpoints

    checkpoints = Checkpoints(directory, every_steps=1, keep=None)
    checkpoints.save(1, kill_state(1), data_state={"step": 1}, config={"run": "kill"})
    checkpoints.wait()
    checkpoints.save(2, kill_state(2), data_state={"step": 2}, config={"run": "kill"})
    print("save-started", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def perturbed(state):
    """The initial state with every leaf changed distinctly, so a restore of zeros (e.g. Adam's mu)
    or of a swapped leaf cannot pass for the saved values."""
    leaves, treedef = jax.tree.flatten(state)
    leaves = [x + jnp.asarray(i + 1, x.dtype) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, leaves)


def source_config():
    """The tiny test model at data 2 x tensor 4 with ZeRO-1 and fp16 (dynamic loss scale)."""
    from tests.reference import with_overrides
    from tests.test_degeneracy import tiny_config

    config = with_overrides(tiny_config(), {"data": 2, "tensor": 4}, parallel={"zero_stage": 1})
    config.train.compute_dtype = "float16"
    return config


def save_multiprocess(directory: str, out: str) -> None:
    from jax.experimental import multihost_utils

    from jaxpar.checkpoint import Checkpoints, check_shared_storage
    from jaxpar.checkpoint.integrity import leaf_names
    from jaxpar.train.setup import build

    check_shared_storage(directory)
    config = source_config()
    program = build(config)
    state = perturbed(program.init())
    with Checkpoints(directory, every_steps=1) as checkpoints:
        checkpoints.save(3, state, data_state={"step": 3}, config=config.to_json_best_effort())
        checkpoints.wait()
    gathered = multihost_utils.process_allgather(state, tiled=True)
    if jax.process_index() == 0:
        np.savez(out, **dict(zip(leaf_names(state), (np.asarray(x) for x in jax.tree.leaves(gathered)))))


def shared_check(prefix: str) -> None:
    from jaxpar.checkpoint import CheckpointError, check_shared_storage

    try:
        check_shared_storage(f"{prefix}{jax.process_index()}", wait_s=1.0)
    except CheckpointError as e:
        print(f"CheckpointError: {e}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    distributed.initialize()  # a no-op outside scripts/launch_local.py
    {"kill_mid_save": kill_mid_save, "save_multiprocess": save_multiprocess, "shared_check": shared_check}[mode](*args)
