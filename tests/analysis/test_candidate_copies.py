"""The planner's cheap candidate copies and per-search memos give what whole copies give.

A candidate's config shares the sections it does not change (`candidates._with_keys`), and within
one search the model's facts and JSON, train's JSON (`layout.shared_model`) and preflight's checks of
one section (`preflight.shared_sections`) are computed once: each compared here with the whole-config
pickle copy the planner made before, priced and checked outside any memo.
"""

from __future__ import annotations

import itertools
import pickle

import pytest

from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.cost.layout import Layout, shared_model
from jaxpar.analysis.planner.candidates import Space, _with_keys, candidates, set_keys
from jaxpar.train.preflight import ConfigError, check, shared_sections
from tests.support import tiny


@pytest.fixture(scope="module")
def config():
    cfg = tiny.llama({"global_batch_size": 16, "seq_len": 32}, vocab_size=256, num_hidden_layers=4, num_key_value_heads=4,
                     hidden_size=64, intermediate_size=128)
    cfg.lock()
    return cfg


def _whole_copy(config, values):
    return set_keys(pickle.loads(pickle.dumps(config)), values)


def _some(config, n=40):
    # Every mesh of 4 devices, each with its first few knob settings (ZeRO, remat, SP, accumulation, schedules).
    return list(itertools.islice(candidates(config, 4, Space(microbatch_options=2)), 0, None, 7))[:n]


def test_a_candidate_equals_a_whole_copy_and_leaves_the_config_alone(config):
    before = config.to_json()
    for c in _some(config):
        applied = c.apply(config)
        assert applied.to_json() == _whole_copy(config, c.values).to_json()
        assert applied.is_locked and applied.model is config.model  # shared, not copied
    assert config.to_json() == before


def test_memoized_pricing_equals_pricing_whole_copies(config):
    with shared_model(config):
        shared = [(c, estimate(c.apply(config), "a100-80g", num_devices=4)) for c in _some(config)]
    assert any(c.get("train.grad_accum", 1) > 1 for c, _ in shared)  # a changed train leaf among them
    for c, got in shared:
        whole = _whole_copy(config, c.values)
        want = estimate(whole, "a100-80g", num_devices=4)
        assert (got.time, got.memory, got.collectives) == (want.time, want.memory, want.collectives), c.describe()
        assert got.layout.train_json == whole.train.to_json() and got.layout.model_json == Layout.from_config(whole, 4).model_json


def test_memoized_checks_refuse_what_whole_copies_refuse(config):
    memo = {}
    with shared_sections(config, memo):
        check(_with_keys(config, {"train.grad_accum": 2}), 4)  # fills the memo with train's fine ranges
    bad = {"train.log_every": 0, "mesh.data": 4}  # a train leaf only train's ranges check
    with pytest.raises(ConfigError) as whole:
        check(_whole_copy(config, bad), 4)
    with shared_sections(config, memo), pytest.raises(ConfigError) as shared:
        check(_with_keys(config, bad), 4)
    assert str(shared.value) == str(whole.value) and "train.log_every=0" in str(whole.value)
