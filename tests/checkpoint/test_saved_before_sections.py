"""A run saved before optimizer and schedule keys moved into their records' sections still resumes.

`data/flat_keys_run` was written by the code of commit 926fd48 (the command is in the commit that
added it, fe953d2): a 2-layer Llama (hidden 16, vocab 256) trained with Muon and the wsd schedule,
every one of their keys off its default, flat as they were then (`train.muon_beta`,
`train.adam_b1`, `train.wsd_decay_fraction`, ...); kept are its config.json, the metrics of steps
1-2, the checkpoint at step 2 and, in expected.jsonl, steps 3-4 of that same uninterrupted run.

- Its config, read in today's layout (`jaxpar.config.upgrade`), is the config a user now types
  for that run with the new keys: no difference at all, so resuming is accepted without a note.
- Resumed through the training loop with the new keys, steps 3 and 4 are those the original run
  computed (loss, gradient norm, learning rate): bitwise on the host that wrote them, within 1e-6
  elsewhere (another host's fp32 sums differ in the last bit: step 3's gradient norm by 1.2e-7).
- Another value of a Muon key, or of the AdamW keys Muon reads, is still refused, naming the key.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxpar.checkpoint import CheckpointError, compare_configs
from jaxpar.checkpoint.listing import saved_config
from jaxpar.config import MOVED_KEYS, upgrade
from tests.support.compile_flags import subprocess_environment
from tests.support.paths import ROOT

DATA = os.path.join(os.path.dirname(__file__), "data", "flat_keys_run")

# The saved run's config as typed today, the optimizer and schedule keys in their sections: the
# config file the resumed run is given, and (executed here) what the fast tests compare with.
CONFIG_FILE = """
from jaxpar.config import base_config
from jaxpar.models import llama


def get_config():
    c = base_config()
    c.model = llama.model_config(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, rope_theta=10000.0, max_position_embeddings=64,
    )
    c.train.update(
        steps=4, global_batch_size=4, seq_len=32, warmup_steps=0, learning_rate=0.01, weight_decay=0.01, optimizer="muon",
        lr_schedule="wsd", final_learning_rate_fraction=0.2, tensorboard=False,
        muon={"beta": 0.9, "ns_steps": 4, "consistent_rms": 0.3, "nesterov": False},
        adamw={"b1": 0.8, "b2": 0.9, "eps": 1e-7},
        wsd={"decay_fraction": 0.5, "decay_shape": "linear"},
    )
    c.data.update(source="tokens", path="tokens.bin")
    c.checkpoint.update(every_steps=2, keep=0, async_save=False)
    return c
"""


def todays_config():
    namespace = {}
    exec(CONFIG_FILE, namespace)
    return namespace["get_config"]()


def saved():
    with open(os.path.join(DATA, "run", "config.json")) as f:
        return json.load(f)


def test_the_saved_config_holds_the_flat_keys():
    """The data is what it claims: every key that moved is there under its old name."""
    train = saved()["train"]
    assert {f"train.{k}" for k in train} >= set(MOVED_KEYS)
    assert train["muon_beta"] == 0.9 and train["adam_b1"] == 0.8 and train["wsd_decay_fraction"] == 0.5


def test_upgraded_it_is_todays_config_of_that_run():
    upgraded = upgrade(saved())
    assert not set(upgraded["train"]) & {k.split(".", 1)[1] for k in MOVED_KEYS}
    assert upgraded["train"]["muon"] == {"beta": 0.9, "ns_steps": 4, "nesterov": False, "consistent_rms": 0.3}
    assert upgraded["train"]["adamw"] == {"b1": 0.8, "b2": 0.9, "eps": 1e-7}
    assert upgraded["train"]["wsd"] == {"decay_fraction": 0.5, "decay_shape": "linear"}
    assert saved()["train"]["muon_beta"] == 0.9  # a copy: the input is left alone
    assert compare_configs(saved(), todays_config().to_json_best_effort(), checkpoint="old") == []
    assert saved_config(os.path.join(DATA, "run", "checkpoints"), 2)["train"]["muon"]["ns_steps"] == 4


@pytest.mark.parametrize(
    "section, key, value, line",
    [
        ("muon", "beta", 0.95, "other muon hyperparameters: train.muon.beta (saved 0.9, now 0.95)"),
        ("adamw", "b1", 0.9, "other muon hyperparameters: train.adamw.b1 (saved 0.8, now 0.9)"),
    ],
)
def test_a_changed_hyperparameter_is_still_refused(section, key, value, line):
    config = todays_config()
    config.train[section][key] = value
    with pytest.raises(CheckpointError) as error:
        compare_configs(saved(), config.to_json_best_effort(), checkpoint="old")
    assert line in str(error.value) and "\n" not in str(error.value)


# Slow: a subprocess compiling at XLA's default settings (the suite's fast-compile flags change the
# loss in its last bits, and the expected steps were computed at the defaults, as a user runs).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_it_resumes_where_the_original_run_went_on(tmp_path):
    for name in os.listdir(DATA):
        copy = shutil.copytree if os.path.isdir(os.path.join(DATA, name)) else shutil.copy
        copy(os.path.join(DATA, name), tmp_path / name)
    (tmp_path / "config.py").write_text(CONFIG_FILE)
    environment = subprocess_environment(XLA_FLAGS="", JAX_PLATFORMS="cpu")
    # cwd: data.path is relative, as it was saved.
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config=config.py", "--workdir=run"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from checkpoint" in done.stdout + done.stderr
    with open(os.path.join(DATA, "expected.jsonl")) as f:
        expected = [json.loads(line) for line in f]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        resumed = [r for r in map(json.loads, f) if "goodput" not in r][2:]
    assert [r["step"] for r in resumed] == [r["step"] for r in expected]
    for mine, original in zip(resumed, expected):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert mine[key] == pytest.approx(original[key], rel=1e-6, abs=0), (mine["step"], key)


def test_a_key_added_since_reads_as_its_default():
    """`train.mtp_loss_weight` did not exist when the run was saved: at its default it is the same run,
    set to something else it is noted (the saved run did not have it)."""
    config = todays_config()
    config.train.mtp_loss_weight = 0.5
    (note,) = compare_configs(saved(), config.to_json_best_effort(), checkpoint="old")
    assert "train.mtp_loss_weight (saved 0.3, now 0.5)" in note
