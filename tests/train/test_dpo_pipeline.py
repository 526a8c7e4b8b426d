"""DPO on a pipeline mesh against one device: the engine's per-token forward (the policy's and the
reference's log-probabilities, `pipelined_target_logps`) and its weighted-token gradient pass give
the one-device run's DPO loss, rewards, accuracy, margin, step-1 gradients and final parameters
after two steps (the first with the policy equal to its reference, the second not). Schedules: a V
(zb_v: both end stages on rank 0) on pipeline 2 × data 2 with the reference copy and the
vocab-parallel head; GPipe with LoRA (the reference is the base without adapters) and the head on
the last stage only (`pipeline_vocab="ends"`). The other schedules run the same engine (1F1B with
LoRA, interleaved, context and MoE meshes were checked by hand: docs/fine_tuning.md).
"""

import jax
import numpy as np
import pytest

from tests.support import tiny
from tests.support.dpo import METRICS, dpo_config, preference_batches, run
from tests.support.pipeline_cases import pp
from tests.support.reference import PARAM_L2_RTOL, PARAM_RTOL, l2_relative_error, max_relative_error
from tests.support.tiers import slow_except

LORA = {"rank": 4, "alpha": 8.0}
# name: (mesh, parallel, LoRA). 4 layers: a V on pipeline 2 runs 4 stages.
CASES = {
    "zb_v_p2_data2": ({"pipeline": 2, "data": 2}, pp("zb_v", 2, 2), None),
    "gpipe_p2_ends_lora": ({"pipeline": 2}, pp("gpipe", 4, pipeline_vocab="ends"), LORA),
}


def single_config(lora):
    config = dpo_config(tiny.llama(num_hidden_layers=4))
    config.train.lora.update(lora or {"rank": 0})
    return config


@pytest.fixture(scope="module")
def one_device():
    """The one-device DPO runs (with and without LoRA), shared by the cases."""
    cache = {}

    def get(lora):
        key = bool(lora)
        if key not in cache:
            config = single_config(lora)
            batches = preference_batches(config.model.vocab_size)
            cache[key] = batches, run(config, batches, 1)
        return cache[key]

    return get


# Fast tier: the V with data (one case for suite time; LoRA's reference on a pipeline: the slow tier).
@pytest.mark.parametrize("case", slow_except(CASES, "zb_v_p2_data2"))
def test_dpo_on_a_pipeline_equals_one_device(case, one_device):
    mesh, parallel, lora = CASES[case]
    batches, one = one_device(lora)
    config = tiny.with_overrides(single_config(lora), mesh, parallel=parallel)
    many = run(config, batches, int(np.prod(list(mesh.values()))), params=one["init"])
    errors = {k: float(np.max(np.abs(np.subtract(many[k], one[k])))) for k in METRICS}
    print(case, errors, max_relative_error(many["grads"], one["grads"]), l2_relative_error(many["final"], one["final"]))
    assert one["rewards_margin"][0] == 0 and one["rewards_margin"][1] != 0  # step 1: the policy is its reference
    assert 0 < one["rewards_accuracy"][1] < 1
    for key in METRICS:
        np.testing.assert_allclose(many[key], one[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert max_relative_error(many["grads"], one["grads"]) <= 1e-4
    assert max_relative_error(many["final"], one["final"]) <= PARAM_RTOL
    assert l2_relative_error(many["final"], one["final"]) <= PARAM_L2_RTOL
    assert jax.tree.structure(many["final"]) == jax.tree.structure(one["final"])
