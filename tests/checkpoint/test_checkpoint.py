"""Checkpoints: exact round trips onto other meshes, every-N / keep-K, interrupted and damaged saves.

References: the saved in-memory state itself (restores must be bit-identical), Orbax's on-disk
layout (an interrupted save is a `*.orbax-checkpoint-tmp` directory), and the files we damage.
"""

import glob
import json
import logging
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.checkpoint import CheckpointError, Checkpoints, check_shared_storage, compare_configs
from jaxpar.checkpoint.integrity import fingerprints
from jaxpar.train.setup import build
from tests.support.checkpoint_worker import kill_state, perturbed, source_config, target_abstract, target_program
from tests.support.compile_flags import subprocess_environment
from tests.support.paths import ROOT
from tests.support.restored import assert_identical, assert_on_shardings
from tests.support.tiny import with_overrides

WORKER = os.path.join(ROOT, "tests", "support", "checkpoint_worker.py")


@pytest.mark.timeout(300)
def test_round_trip_onto_other_meshes(tmp_path):
    config = source_config()
    program = build(config)
    state = perturbed(program.init())
    checkpoints = Checkpoints(str(tmp_path), every_steps=5)
    start = time.perf_counter()
    assert checkpoints.save(5, state, data_state={"step": 5}, config=config.to_json_best_effort())
    returned = time.perf_counter() - start
    checkpoints.wait()
    print(f"tiny state save: returned after {returned:.2f}s, complete after {time.perf_counter() - start:.2f}s")
    # Targets: tensor 8 (ZeRO-0), and one device.
    for mesh, devices in (({"tensor": 8}, 8), ({}, 1)):
        target = target_program(mesh, devices)
        start = time.perf_counter()
        restored = checkpoints.restore(None, target_abstract(target))
        jax.block_until_ready(restored.state)
        print(f"tiny state restore onto {mesh or 'one device'}: {time.perf_counter() - start:.2f}s")
        assert restored.step == 5 and restored.data_state == {"step": 5} and restored.notes == ()
        assert restored.config == json.loads(config.to_json_best_effort())
        assert_identical(restored.state, state)
        assert_on_shardings(restored.state, target.state_shardings)
        # Static fields come from the abstract state: fp16 → dynamic loss scaling.
        assert restored.state.loss_scale.dynamic and restored.state.loss_scale.period == config.train.loss_scale_period
    # Positive control for the sharding check: the source layout really differs from tensor 8.
    source = program.state_shardings.opt_state, target_program({"tensor": 8}, 8).state_shardings.opt_state
    assert any(not a.is_equivalent_to(b, 2) for a, b in zip(jax.tree.leaves(source[0]), jax.tree.leaves(source[1])))
    checkpoints.close()


def small_state(value: float = 0.0):
    mesh = jax.make_mesh((4,), ("shard",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
    sharded, replicated = NamedSharding(mesh, P("shard")), NamedSharding(mesh, P())
    return {
        "w": jax.device_put(jax.random.normal(jax.random.key(0), (256, 64)) + value, sharded),
        "step": jax.device_put(jnp.asarray(int(value), jnp.int32), replicated),
    }


def small_abstract():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), small_state())


@pytest.mark.timeout(120)
def test_every_n_steps_and_keep_last_k(tmp_path):
    with Checkpoints(str(tmp_path), every_steps=2, keep=2) as checkpoints:
        saved = [s for s in range(1, 8) if checkpoints.save(s, small_state(s), data_state={"step": s}, config={})]
        assert saved == [2, 4, 6]
        assert checkpoints.save(7, small_state(7), data_state={"step": 7}, config={}, force=True)
        assert not checkpoints.save(7, small_state(7), data_state={"step": 7}, config={}, force=True), (
            "never overwrites"
        )
        checkpoints.wait()
        assert checkpoints.all_steps() == [6, 7]
    assert sorted(os.listdir(tmp_path)) == ["6", "7"]
    with Checkpoints(str(tmp_path), every_steps=0, keep=None) as reopened:
        assert reopened.latest_step() == 7
        assert not reopened.should_save(100) and reopened.should_save(100, force=True)
        assert_identical(reopened.restore(6, small_abstract()).state, small_state(6))


@pytest.mark.timeout(120)
def test_latest_step_excludes_an_unfinished_async_save(tmp_path):
    with Checkpoints(str(tmp_path), every_steps=1) as checkpoints:
        checkpoints.save(1, small_state(1), data_state={}, config={})
        checkpoints.wait()
        checkpoints.save(2, kill_state(1), data_state={}, config={})  # 64 MiB: still committing on return
        assert os.path.isdir(tmp_path / "2.orbax-checkpoint-tmp"), "the commit outran this check"
        assert checkpoints.latest_step() == 1 and checkpoints.all_steps() == [1]
        checkpoints.wait()
        assert checkpoints.latest_step() == 2
    assert sorted(os.listdir(tmp_path)) == ["1", "2"], "Orbax removed the interrupted save's directory"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill_9_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    env = subprocess_environment()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, WORKER, "kill_mid_save", str(tmp_path)], env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == -9, done.stderr[-3000:]
    assert "save-started" in done.stdout
    tmp_dir = str(tmp_path / "2.orbax-checkpoint-tmp")
    assert os.path.isdir(tmp_dir) and not os.path.exists(tmp_path / "2"), os.listdir(tmp_path)

    with Checkpoints(str(tmp_path), every_steps=1, read_only=True) as reader:
        assert reader.latest_step() == 1 and reader.all_steps() == [1]
        assert reader.incomplete == (tmp_dir,)
        assert tmp_dir in reader.notes[0] and "incomplete" in reader.notes[0]
    assert os.path.isdir(tmp_dir), "read-only must not remove anything"

    with Checkpoints(str(tmp_path), every_steps=1) as checkpoints:
        assert checkpoints.incomplete == (tmp_dir,)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), kill_state(1))
        restored = checkpoints.restore(None, abstract)
        assert restored.step == 1 and restored.data_state == {"step": 1}
        assert_identical(restored.state, kill_state(1))
        assert checkpoints.save(2, kill_state(2), data_state={"step": 2}, config={}), "step 2 can be saved again"
        checkpoints.wait()
        assert checkpoints.latest_step() == 2
    assert sorted(os.listdir(tmp_path)) == ["1", "2"], "Orbax removed the interrupted save's directory"


@pytest.mark.timeout(120)
def test_async_save_is_unaffected_by_donating_the_state_right_after(tmp_path):
    # The training step donates the state it is given; save() must have taken its copy by then.
    # (On CPU Orbax's host copy aliases the buffers, so XLA skips that one donation instead.)
    state = kill_state(1)
    overwrite = jax.jit(lambda tree: jax.tree.map(lambda x: x * 0 + 7, tree), donate_argnums=0)
    with Checkpoints(str(tmp_path), every_steps=1) as checkpoints:
        checkpoints.save(1, state, data_state={}, config={})
        jax.block_until_ready(overwrite(state))
        checkpoints.wait()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), kill_state(1))
        assert_identical(checkpoints.restore(1, abstract).state, kill_state(1))


def _damage(path: str, how: str) -> str:
    files = [f for f in glob.glob(os.path.join(path, "state", "**", "d", "*"), recursive=True) if os.path.isfile(f)]
    victim = max(files, key=os.path.getsize)  # the chunk data of `w`
    if how == "missing":
        os.remove(victim)
    elif how == "empty":
        open(victim, "w").close()
    else:  # one flipped bit in the middle of the data
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))
    return victim


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["missing", "empty", "bitflip"])
def test_damaged_checkpoint_names_itself_and_falls_back(tmp_path, how):
    with Checkpoints(str(tmp_path), every_steps=1) as checkpoints:
        for step in (1, 2):
            checkpoints.save(step, small_state(step), data_state={"step": step}, config={})
    _damage(str(tmp_path / "2"), how)
    if how == "bitflip":
        # Positive control: without fingerprints the flipped bit restores silently as a wrong value.
        with Checkpoints(str(tmp_path), every_steps=1, read_only=True, verify=False) as unverified:
            wrong = unverified.restore(2, small_abstract()).state["w"]
            assert not np.array_equal(np.asarray(wrong), np.asarray(small_state(2)["w"]))

    with Checkpoints(str(tmp_path), every_steps=1) as checkpoints:
        with pytest.raises(CheckpointError) as error:
            checkpoints.restore(2, small_abstract())
        message = str(error.value)
        assert "\n" not in message and f"checkpoint {tmp_path / '2'} is unreadable" in message, message
        print(f"{how}: {message}")

        restored = checkpoints.restore(None, small_abstract())
        assert restored.step == 1
        assert_identical(restored.state, small_state(1))
        assert len(restored.notes) == 1 and str(tmp_path / "2") in restored.notes[0]
        assert os.path.isdir(tmp_path / "2.unreadable") and checkpoints.all_steps() == [1]


def test_fingerprints_do_not_depend_on_sharding():
    state = small_state(3)
    one_device = jax.device_put(state, jax.devices()[0])
    assert fingerprints(state) == fingerprints(one_device)
    flipped = dict(state, w=state["w"].at[17, 5].set(-state["w"][17, 5]))
    assert (
        fingerprints(flipped)["w"] != fingerprints(state)["w"]
        and fingerprints(flipped)["step"] == fingerprints(state)["step"]
    )


def test_save_rejects_a_leaf_that_is_not_a_jax_array(tmp_path):
    with Checkpoints(str(tmp_path), every_steps=1) as checkpoints:
        with pytest.raises(CheckpointError, match=r"state leaf count is a int, not a jax.Array"):
            checkpoints.save(1, {"count": 3}, data_state={}, config={})


def test_a_checkpoint_that_would_not_fit_is_refused_before_writing(tmp_path, monkeypatch):
    """The free-space probe is faked (no real full disk): the save is refused in one line naming the
    path and the bytes needed vs free, and nothing is written, not even an incomplete save."""
    from jaxpar.checkpoint import storage

    program = target_program({"data": 2, "tensor": 4}, 8)
    state = program.init()
    needed = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    free = {"bytes": needed - 1}
    monkeypatch.setattr(storage, "free_bytes", lambda directory: free["bytes"])
    directory = tmp_path / "checkpoints"
    with Checkpoints(str(directory), every_steps=1) as checkpoints:
        with pytest.raises(CheckpointError) as error:
            checkpoints.save(1, state, data_state={"step": 1}, config={})
        (line,) = str(error.value).splitlines()
        assert line.startswith(f"checkpoint.dir={directory} has {needed - 1} bytes") and f"needs about {needed} bytes" in line
        assert os.listdir(directory) == []
        free["bytes"] = needed
        assert checkpoints.save(1, state, data_state={"step": 1}, config={})
        checkpoints.wait()
    assert sorted(os.listdir(directory)) == ["1"]
    # A run checks at start, before compiling, that its first checkpoint will fit.
    from jaxpar.train.loop import train
    from tests.support import tiny

    free["bytes"] = 1000
    with pytest.raises(CheckpointError, match=r"has 1000 bytes \(1000 B\) free but a checkpoint of this run needs about"):
        train(tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 8}, data={"max_corpus_bytes": 100_000}), str(tmp_path / "run"),
              progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything was written: no workdir, no empty checkpoints/


def test_compare_configs():
    saved = source_config()
    assert compare_configs(saved.to_json_best_effort(), saved.to_json_best_effort(), checkpoint="/c/3") == []
    relaid = with_overrides(saved, {"tensor": 8}, parallel={"zero_stage": 3},
                            train={"steps": 99, "loggers": "tensorboard,mlflow", "mlflow_experiment": "other"})
    assert compare_configs(saved.to_json_best_effort(), relaid.to_json_best_effort(), checkpoint="/c/3") == []
    reseeded = with_overrides(saved, {"data": 2, "tensor": 4}, train={"seed": 1})
    (note,) = compare_configs(saved.to_json_best_effort(), reseeded.to_json_best_effort(), checkpoint="/c/3")
    assert "train.seed (saved 0, now 1)" in note
    other_model = with_overrides(saved, {"data": 2, "tensor": 4})
    other_model.model.hidden_size = 128
    other_model.model.num_hidden_layers = 3
    with pytest.raises(CheckpointError) as error:
        compare_configs(saved.to_json_best_effort(), other_model.to_json_best_effort(), checkpoint="/c/3")
    assert str(error.value).startswith(
        "checkpoint /c/3 was saved with a different model: "
        "model.hidden_size (saved 64, now 128), model.num_hidden_layers (saved 2, now 3)"
    )


def test_compare_configs_refuses_another_optimizer_or_its_hyperparameters():
    saved = source_config()
    lion = with_overrides(saved, {}, train={"optimizer": "lion"})
    with pytest.raises(CheckpointError) as error:
        compare_configs(saved.to_json_best_effort(), lion.to_json_best_effort(), checkpoint="/c/3")
    (line,) = str(error.value).splitlines()
    assert line.startswith("checkpoint /c/3 was saved with train.optimizer='adamw' but this run uses train.optimizer='lion'")
    # A checkpoint written before train.optimizer existed was AdamW's.
    old = json.loads(saved.to_json_best_effort())
    del old["train"]["optimizer"]
    assert compare_configs(old, saved.to_json_best_effort(), checkpoint="/c/3") == []
    with pytest.raises(CheckpointError, match="train.optimizer='adamw' but this run uses train.optimizer='lion'"):
        compare_configs(old, lion.to_json_best_effort(), checkpoint="/c/3")
    other_beta = with_overrides(saved, {}, train={"adamw": {"b2": 0.99}})
    with pytest.raises(CheckpointError, match=r"other adamw hyperparameters: train.adamw.b2 \(saved 0.95, now 0.99\)"):
        compare_configs(saved.to_json_best_effort(), other_beta.to_json_best_effort(), checkpoint="/c/3")
    # Another optimizer's keys, the learning rate, the schedule and its length may change (noted).
    retuned = with_overrides(saved, {}, train={"lion": {"b1": 0.5}, "learning_rate": 1e-3, "lr_schedule": "wsd", "steps": 500})
    (note,) = compare_configs(saved.to_json_best_effort(), retuned.to_json_best_effort(), checkpoint="/c/3")
    assert "train.learning_rate" in note and "train.lr_schedule" in note and "train.steps" not in note


def test_compare_configs_treats_derived_defaults_as_equal():
    """A key left to its derived default and the value it derives to are the same config; keys
    another key makes unused never differ; a real difference in either still refuses."""
    explicit = source_config()
    explicit.model.head_dim = explicit.model.hidden_size // explicit.model.num_attention_heads
    derived = with_overrides(explicit, {"data": 2, "tensor": 4})
    derived.model.head_dim = None
    derived.model.rope_scaling.factor = 2.0  # unused by rope_type "default"
    derived.data.token_dtype = "uint32"  # unused by data.source "stdlib"
    derived.data.path = ""
    assert compare_configs(explicit.to_json_best_effort(), derived.to_json_best_effort(), checkpoint="/c/3") == []
    assert compare_configs(derived.to_json_best_effort(), explicit.to_json_best_effort(), checkpoint="/c/3") == []
    derived.model.head_dim = 2 * explicit.model.head_dim
    with pytest.raises(CheckpointError, match=r"model.head_dim \(saved 8, now 16\)"):
        compare_configs(explicit.to_json_best_effort(), derived.to_json_best_effort(), checkpoint="/c/3")
    llama3 = with_overrides(explicit, {"data": 2, "tensor": 4})
    llama3.model.rope_scaling.rope_type = "llama3"
    other = with_overrides(llama3, {"data": 2, "tensor": 4})
    other.model.rope_scaling.factor = 2.0
    with pytest.raises(CheckpointError, match=r"model.rope_scaling.factor \(saved 8.0, now 2.0\)"):
        compare_configs(llama3.to_json_best_effort(), other.to_json_best_effort(), checkpoint="/c/3")


def test_shared_storage_check_single_process(tmp_path):
    check_shared_storage(str(tmp_path / "new" / "dir"))
    assert os.path.isdir(tmp_path / "new" / "dir") and os.listdir(tmp_path / "new" / "dir") == []
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(
        CheckpointError, match=r"^checkpoint.dir=.*a_file/sub is not writable \(.*\); set checkpoint.dir"
    ):
        check_shared_storage(str(blocker / "sub"))


def test_a_read_only_open_is_quiet_and_orbax_alone_is_not(tmp_path, caplog):
    """A reader (convert.py --to_hf, sample.py) is read-only by design: Orbax's warnings saying so are
    dropped while jaxpar opens one, and only then (the bare Orbax open after it still says them)."""
    caplog.set_level(logging.WARNING)  # what a user sees on stderr
    with Checkpoints(str(tmp_path), every_steps=0, read_only=True) as reader:
        assert reader.all_steps() == []
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "read only" in m or "read_only" in m], said
    caplog.clear()
    ocp.CheckpointManager(str(tmp_path), options=ocp.CheckpointManagerOptions(read_only=True, create=False)).close()
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("Given directory is read only") for m in said), said
    assert any(m.startswith("CheckpointManagerOptions.read_only=True") for m in said), said
