"""The V-shaped schedules (`zb_v`, `dualpipev`) train exactly like one device, reached through the
config like every other schedule (`parallel.pipeline_schedule`; `parallel.virtual_stages` left at 0
takes the record's 2, any other value than 2 is refused naming the key).

The comparison and tolerances of `tests/parallel/pipeline/test_pipeline.py` (Llama) and `tests/parallel/pipeline/test_pipeline_moe.py`
(Mixtral against one device with `grad_accum` = m): 3 fp32 steps, identical initial params, step-1
loss and gradients within 1e-5 relative, every step's loss and gradient norm within 1e-4. Few
cases, each combining several axes (compiles dominate the time): uneven auto and explicit splits,
data with ZeRO-1 and ZeRO-3, tensor + SP, both vocab placements (with "ends" both ends sit on rank
0), context and expert.
"""

import math

import numpy as np
import pytest

from jaxpar import models
from jaxpar.mesh import resolve_mesh_shape
from jaxpar.parallel.pipeline.options import checks as pipeline_checks
from jaxpar.parallel.pipeline.options import pipeline_options
from tests.support import tiny
from tests.support.pipeline_cases import STEPS, pipeline_config, pp
from tests.support.reference import assert_matches_reference, run, single_device, synthetic_batches
from tests.support.tiers import slow_except

# name: (family, model overrides, mesh, parallel); splits `auto` unless given.
CASES = {
    # 7 layers over 4 stages (replicated storage), data 2 with ZeRO-1.
    "zb_v_p2_data2_zero1_7layers_auto": (
        "llama", {"num_hidden_layers": 7}, {"pipeline": 2, "data": 2}, pp("zb_v", 4, 2, zero_stage=1),
    ),
    # p = 4: hops +1, 0 and -1; the embedding and head at the ends (both on rank 0).
    # v 0: the record's own (2), so the fast tier runs a V schedule the way a user types it.
    "zb_v_p4_ends": ("llama", {}, {"pipeline": 4}, pp("zb_v", 4, 0, pipeline_vocab="ends")),
    # Uneven explicit split, ZeRO-3 over data with tensor + SP.
    "dualpipev_p2_data2_tensor2_zero3_sp_1_3_2_2": (
        "llama", {}, {"pipeline": 2, "data": 2, "tensor": 2},
        pp("dualpipev", 4, 2, zero_stage=3, sequence_parallel=True, pipeline_stage_layers="1,3,2,2"),
    ),
    # MoE through a V once: dualpipev, whose steady cells pair two microbatches; zb_v shares its
    # placement and B/W split (a zb_v Mixtral case cost 65 s of the suite's time for no new path).
    "dualpipev_p2_context2_expert2_mixtral": (
        "mixtral", {"num_hidden_layers": 4}, {"pipeline": 2, "context": 2, "expert": 2}, pp("dualpipev", 4, 2),
    ),
}


@pytest.mark.timeout(900)  # measured 150-270 s per case with 6 workers on 2 cores
# Fast tier: one V schedule case.
@pytest.mark.parametrize("name", slow_except(CASES, "zb_v_p4_ends"))
def test_matches_single_device(name, shared_cache):
    family, model, mesh, parallel = CASES[name]
    moe = family == "mixtral"
    base = tiny.mixtral(**model) if moe else pipeline_config(**model)
    config = tiny.with_overrides(base, mesh, parallel=parallel)
    devices = math.prod(mesh.values())
    sizes = resolve_mesh_shape(config.mesh, devices)
    assert pipeline_checks(config, sizes, has_aux_losses=moe) == []
    opts = pipeline_options(config, sizes, models.facts(config.model))
    assert opts.table.name == parallel["pipeline_schedule"] and not opts.table.modular
    if "auto" in name or "_1_3_2_2" in name:
        assert len(set(opts.stage_layers)) > 1, f"{name} should run an uneven split, got {opts.stage_layers}"
    # MoE: the router losses are per microbatch, so one device accumulates the same microbatches.
    one = tiny.with_overrides(config, {}, train={"grad_accum": parallel["num_microbatches"]}) if moe else config
    expected = single_device(shared_cache, one, STEPS)
    result = run(config, synthetic_batches(config, STEPS), devices, expected["init_params"])
    assert_matches_reference(result, expected)
    if moe:
        np.testing.assert_allclose(result["expert_fractions"], expected["expert_fractions"], atol=1e-6)


# The v each schedule is built for (Narayanan et al. 2021 interleave with v >= 2; ZB-V and DualPipeV
# place exactly two chunks per rank in a V), written here rather than read from the records.
@pytest.mark.parametrize("schedule, v", [
    ("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipev", 2),
])
def test_virtual_stages_default_to_the_schedules_own(schedule, v):
    config = tiny.with_overrides(pipeline_config(), {"pipeline": 2}, parallel={"pipeline_schedule": schedule, "num_microbatches": 4})
    assert config.parallel.virtual_stages == 0  # the default: nothing typed
    sizes = resolve_mesh_shape(config.mesh, 2)
    assert pipeline_checks(config, sizes, has_aux_losses=False) == []
    opts = pipeline_options(config, sizes, models.facts(config.model))
    assert opts.virtual_stages == opts.table.virtual_stages == opts.table.num_stages // 2 == v


@pytest.mark.parametrize("mesh, parallel, expected", [
    ({"pipeline": 2}, pp("zb_v", 4), "parallel.virtual_stages=1 must be 2 for parallel.pipeline_schedule='zb_v'"),
    ({"pipeline": 4}, pp("zb_v", 2, 2), "parallel.num_microbatches=2 must be at least mesh.pipeline=4 for zb_v"),
    ({"pipeline": 4}, pp("dualpipev", 4, 2), "parallel.num_microbatches=4 must be at least 2 × mesh.pipeline=8"),
    ({"pipeline": 2}, pp("dualpipev", 4, 3), "parallel.virtual_stages=3 must be 2 for parallel.pipeline_schedule='dualpipev'"),
    ({"pipeline": 2}, pp("zb_v", 4, -1), "parallel.virtual_stages=-1 must be >= 0 (0: the schedule's own)"),
    # 8 layers cannot fill 2 stages on each of 8 ranks.
    ({"pipeline": 8}, pp("zb_v", 8, 2), "model.num_hidden_layers=8 cannot fill mesh.pipeline × parallel.virtual_stages=16"),
])
def test_preflight_one_line_errors(mesh, parallel, expected):
    config = tiny.with_overrides(pipeline_config(), mesh, parallel=parallel, train={"global_batch_size": 16})
    errors = pipeline_checks(config, resolve_mesh_shape(config.mesh, math.prod(mesh.values())), has_aux_losses=False)
    assert len(errors) == 1 and expected in errors[0] and "\n" not in errors[0], errors
