"""Subprocess side of tests/checkpoint/test_checkpoint.py and tests/distributed/test_distributed.py.

python tests/support/checkpoint_worker.py kill_mid_save DIR
    saves step 1 (waits for it), starts an async save of step 2 and SIGKILLs itself as soon as
    its temporary folder exists, i.e. while the background commit is still writing (Orbax may make
    that folder after save() returns: on a loaded host a kill at once came before it).
python tests/support/checkpoint_worker.py save_multiprocess DIR OUT.npz     (under scripts/launch_local.py)
    checks DIR is shared, builds the tiny TrainState on all processes' devices, saves it as step 3
    and (process 0) writes the state gathered from all processes to OUT.npz as the reference.
python tests/support/checkpoint_worker.py shared_check DIR_PREFIX          (under scripts/launch_local.py)
    runs check_shared_storage on DIR_PREFIX + process index: must fail with its one-line error.
"""

import os
import signal
import sys
import time

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
    in_flight, deadline = os.path.join(directory, "2.orbax-checkpoint-tmp"), time.monotonic() + 60
    while not os.path.isdir(in_flight) and time.monotonic() < deadline:
        time.sleep(0.001)
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
    from tests.support import tiny

    config = tiny.with_overrides(tiny.llama(), {"data": 2, "tensor": 4}, parallel={"zero_stage": 1})
    config.train.compute_dtype = "float16"
    return config


def target_program(mesh: dict, num_devices: int):
    """The source model built for restoring onto another mesh (ZeRO-0) over the first devices."""
    from jaxpar.train.setup import build
    from tests.support.tiny import with_overrides

    config = with_overrides(source_config(), mesh, parallel={"zero_stage": 0})
    return build(config, jax.devices()[:num_devices])


def target_abstract(program):
    from jaxpar.checkpoint import abstract_state

    return abstract_state(jax.eval_shape(program.init), program.state_shardings)


def save_multiprocess(directory: str, out: str) -> None:
    """Saves steps 3 and 4, damages 4 (a data file of process 1's store removed), then restores in
    these two processes onto tensor 8: both must fall back to 3 together and get the saved values."""
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
        checkpoints.save(4, perturbed(state), data_state={"step": 4}, config=config.to_json_best_effort())
        checkpoints.wait()
    gathered = jax.tree.leaves(multihost_utils.process_allgather(state, tiled=True))
    if jax.process_index() == 0:
        np.savez(out, **dict(zip(leaf_names(state), (np.asarray(x) for x in gathered))))
        store = os.path.join(directory, "4", "state", "ocdbt.process_1", "d")
        os.remove(max((os.path.join(store, f) for f in os.listdir(store)), key=os.path.getsize))
    multihost_utils.sync_global_devices("damaged step 4")

    with Checkpoints(directory, every_steps=1) as checkpoints:
        restored = checkpoints.restore(None, target_abstract(target_program({"tensor": 8}, 8)))
    assert restored.step == 3 and len(restored.notes) == 1 and "/4 is unreadable" in restored.notes[0], restored.notes
    for got, want in zip(jax.tree.leaves(multihost_utils.process_allgather(restored.state, tiled=True)), gathered):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    print(f"2-process restore fell back to step 3: {restored.notes[0]}", flush=True)


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
