"""Loading a run for inference (`jaxpar.loading.load`), checked against Orbax reading the same files.

The checkpoint in tests/checkpoint/data/flat_keys_run was written before keys that exist today
(`train.mtp_loss_weight`, the optimizer sections, `eval.harness_*`): loading it must read those keys
as their defaults, and the params it places on the sampling mesh must be exactly what Orbax's own
reader finds in the files, with no jaxpar program involved.
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.loading.load import load
from jaxpar.sampling import SampleError

CHECKPOINTS = os.path.join(os.path.dirname(__file__), "..", "checkpoint", "data", "flat_keys_run", "run", "checkpoints")


def test_a_checkpoint_saved_before_todays_keys_loads_its_exact_params():
    loaded = load(checkpoint=CHECKPOINTS)
    assert loaded.source.endswith("checkpoints/2 (step 2)")
    raw = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(CHECKPOINTS, "2", "state")))
    got, want = jax.tree.leaves(jax.device_get(loaded.params)), jax.tree.leaves(raw["params"])
    assert len(got) == len(want) == 12
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_exactly_one_source():
    for kwargs in ({}, {"workdir": "a", "from_hf": "b"}):
        try:
            load(**kwargs)
        except SampleError as e:
            assert "give exactly one of workdir=, checkpoint=, from_hf=" in str(e)
        else:
            raise AssertionError(kwargs)
