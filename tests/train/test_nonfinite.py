"""Non-finite steps: never trained on, never checkpointed, never written as NaN tokens.

The real runs use learning_rate=1e6: step 2's update blows the weights up and step 3's gradient
norm is NaN (measured). The reference for "not trained on" is the state before that step: the
skipped steps must leave params and optimizer state bit-identical to it.
"""

import json
import os

import jax
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpoints, abstract_state
from jaxpar.train.loop import train
from jaxpar.train.nonfinite import NonFiniteGuard, NonFiniteStop
from jaxpar.train.setup import build
from tests.support import tiny


def guard_train(**overrides):
    return tiny.llama({"max_skipped_steps": 2, "skip_window": 4, "max_skipped_fraction": 0.5, **overrides}).train


def step_metrics(skipped, loss=1.0, grad_norm=1.0, scale=1.0):
    return {"skipped_steps": skipped, "loss": loss, "grad_norm": grad_norm, "loss_scale": scale}


def test_guard_stops_at_the_first_nonfinite_step_by_default():
    guard = NonFiniteGuard(guard_train())
    guard.observe(1, step_metrics(0))
    with pytest.raises(NonFiniteStop) as error:
        guard.observe(2, step_metrics(1, grad_norm=float("nan")))
    (line,) = str(error.value).splitlines()
    assert line.startswith("step 2: non-finite gradient norm (nan)") and "train.on_nonfinite=skip" in line
    with pytest.raises(NonFiniteStop, match=r"^step 7: non-finite loss \(inf\)"):
        NonFiniteGuard(guard_train()).observe(7, step_metrics(1, loss=float("inf")))


def test_guard_skips_up_to_the_cap_counting_skips_from_before_a_resume():
    guard = NonFiniteGuard(guard_train(on_nonfinite="skip"), skipped_before=1)
    guard.observe(5, step_metrics(2, loss=float("nan")))  # 2 skipped in all: at the cap, not past it
    guard.observe(6, step_metrics(2))
    with pytest.raises(NonFiniteStop, match=r"^step 7: .*3 steps skipped in all, more than train.max_skipped_steps=2"):
        guard.observe(7, step_metrics(3, loss=float("nan")))


def test_guard_fp16_stops_at_the_smallest_scale_and_on_too_many_recent_skips():
    guard = NonFiniteGuard(guard_train(compute_dtype="float16"))
    guard.observe(1, step_metrics(1, scale=4.0))  # an overflow while the scale can still shrink: fine
    guard.observe(2, step_metrics(2, scale=2.0))
    with pytest.raises(NonFiniteStop, match=r"^step 3: fp16 gradients overflow even at the smallest loss scale"):
        guard.observe(3, step_metrics(3, scale=1.0))
    guard = NonFiniteGuard(guard_train(compute_dtype="float16"))
    for step, skipped in enumerate([1, 1, 1], 1):  # window of 4 not yet full: no verdict
        guard.observe(step, step_metrics(step if skipped else 0, scale=1024.0))
    with pytest.raises(NonFiniteStop, match=r"^step 4: 3 of the last 4 fp16 steps overflowed"):
        guard.observe(4, step_metrics(3, scale=1024.0))


def nan_config(**train_overrides):
    return tiny.with_overrides(
        tiny.llama(vocab_size=256), {"data": 2, "tensor": 4},
        data={"max_corpus_bytes": 100_000},
        train={"steps": 8, "learning_rate": 1e6, **train_overrides},
        checkpoint={"every_steps": 1, "keep": 0},
    )


def strict_lines(workdir):
    """metrics.jsonl's step records (not the goodput record at the end), each strict JSON."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line, parse_constant=lambda t: pytest.fail(f"non-standard JSON token {t}")) for line in f]
    return [r for r in records if "goodput" not in r]


def restore(config, directory, step):
    program = build(config)
    with Checkpoints(directory, every_steps=0, read_only=True) as checkpoints:
        return checkpoints.restore(step, abstract_state(jax.eval_shape(program.init), program.state_shardings))


@pytest.mark.timeout(300)
def test_nonfinite_run_stops_and_the_last_good_checkpoint_stays_latest(tmp_path):
    config = nan_config()
    with pytest.raises(NonFiniteStop) as error:
        train(config, str(tmp_path), progress=False)
    (line,) = str(error.value).splitlines()
    assert line.startswith("step 3: non-finite gradient norm (nan)"), line
    records = strict_lines(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["grad_norm"] is None
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"], "the bad step was saved"
    state = restore(config, str(tmp_path / "checkpoints"), 2).state
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    assert not (tmp_path / ".lock").exists(), "the lock was not released"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_skip_policy_leaves_the_state_untouched_and_stops_past_the_cap(tmp_path):
    config = nan_config(on_nonfinite="skip", max_skipped_steps=2)
    with pytest.raises(NonFiniteStop, match=r"^step 5: .*3 steps skipped in all, more than train.max_skipped_steps=2"):
        train(config, str(tmp_path), progress=False)
    records = strict_lines(tmp_path)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "3", "4"]
    before, after = restore(config, str(tmp_path / "checkpoints"), 2), restore(config, str(tmp_path / "checkpoints"), 4)
    assert int(after.state.step) == 2 and int(after.state.loss_scale.skipped_steps) == 2
    for a, b in zip(jax.tree.leaves((before.state.params, before.state.opt_state)),
                    jax.tree.leaves((after.state.params, after.state.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
