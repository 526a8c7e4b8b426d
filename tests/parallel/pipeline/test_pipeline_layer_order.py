"""Layer stacks stored in the schedule's order (`layout.storage_order`, `PipelineOptions.
layers_in_schedule_order`, set by the plan for interleaved and V layouts and applied to the train
state by `pipeline/order.py`): every rank's stages are already in its storage block, so the
engine moves no layers — measured on the compiled production step of a config-built run — and
the step trains as on the natural order.

Bytes over `pipeline` per training step, from the compiled HLO (`analysis.program.compiled.
pipeline_traffic`: every collective whose devices differ only along `pipeline`, times its
executions): the layer exchange (collective-permutes outside the schedule's scan: parameters
before it, gradients after) and the rest (activations, gradients and the vocab-parallel
all-reduces, inside it). Storage in the
schedule's order removes the first and leaves the second unchanged; the natural order is the
positive control (it does move layers for these schedules).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.program.compiled import pipeline_traffic
from jaxpar.axes import PIPELINE
from jaxpar.parallel.pipeline import options
from jaxpar.parallel.pipeline.layout import stage_layout, storage_order, to_stages
from jaxpar.parallel.pipeline.table import modular_stages
from jaxpar.parallel.pipeline.vshape import v_stages
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.pipeline_cases import pipeline_config, pp
from tests.support.reference import PARAM_L2_RTOL, PARAM_RTOL, l2_relative_error, max_relative_error, synthetic_batches


@pytest.mark.parametrize("split, p, v, stages", [
    ((1,) * 8, 4, 2, modular_stages(4, 2)),  # interleaved
    ((2,) * 8, 4, 2, v_stages(4)),  # V
    ((1, 2, 1, 2, 1, 2, 1, 2), 4, 2, v_stages(4)),  # uneven, rank totals 3, 3, 3, 3: no exchange
    ((1, 2, 1, 2, 1, 1, 2, 2), 4, 2, v_stages(4)),  # rank totals 3, 4, 2, 3: one layer moves
    ((1, 1, 2, 1, 1, 2), 3, 2, v_stages(3)),  # 8 layers on 3 ranks: replicated storage
])
def test_each_rank_gets_its_stages_from_schedule_ordered_storage(split, p, v, stages):
    """The real `to_stages` on p pipeline devices over layer ids stored in `storage_order`."""
    order = storage_order(split, p, v, stages)
    layout = stage_layout(split, p, v, stages, order)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), (PIPELINE,))
    spec = jax.sharding.PartitionSpec(PIPELINE) if layout.sharded else jax.sharding.PartitionSpec()
    ids = jax.device_put(jnp.asarray(order, jnp.float32)[:, None], jax.sharding.NamedSharding(mesh, spec))
    tables = {k: jax.device_put(t, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(PIPELINE)))
              for k, t in layout.tables.items()}
    run = jax.shard_map(lambda x, t: to_stages(x, t, layout)[None], mesh=mesh,
                        in_specs=(spec, jax.sharding.PartitionSpec(PIPELINE)), out_specs=jax.sharding.PartitionSpec(PIPELINE))
    staged = np.asarray(run(ids, tables))[..., 0]
    starts = np.cumsum((0,) + split)
    for s, (r, u) in enumerate(stages):
        assert list(staged[r, u, : split[s]]) == list(range(starts[s], starts[s + 1])), (s, r, u)
    block = sum(split) // p
    totals = [sum(n for n, (r, _) in zip(split, stages) if r == q) for q in range(p)]
    assert bool(layout.shifts) == (layout.sharded and totals != [block] * p)
    assert layout.identity == (layout.sharded and len(set(split)) == 1)


def build_program(schedule, m, v, monkeypatch, stored: bool):
    """The config-built program (`setup.build`); `stored=False` overrides the plan's decision
    (`options.stores_in_schedule_order`), the positive control."""
    config = tiny.with_overrides(pipeline_config(), {"pipeline": 2}, parallel=pp(schedule, m, v))
    with monkeypatch.context() as patch:
        if not stored:
            patch.setattr(options, "stores_in_schedule_order", lambda *_: False)
        program = build(config, jax.devices()[:2])
    assert program.plan.pipeline.layers_in_schedule_order == stored
    return config, program


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule, m, v", [("interleaved_1f1b", 4, 2), ("zb_v", 2, 2)])
def test_schedule_order_moves_no_layers_and_trains_the_same(schedule, m, v, monkeypatch):
    """The production step of a config-built run: the plan stores the layers in the schedule's
    order, the state holds them so (`pipeline/order.py`), and the step exchanges no layers; one
    step from the same initial params gives the same loss (bitwise) and parameters (within the
    degeneracy bounds)."""
    config, natural = build_program(schedule, m, v, monkeypatch, stored=False)
    _, ordered = build_program(schedule, m, v, monkeypatch, stored=True)
    order = ordered.plan.pipeline.stored_order
    assert sorted(order) == list(range(8)) and order != tuple(range(8))
    batch = synthetic_batches(config, 1)[0]
    moved, after = {}, {}
    for name, program in (("natural", natural), ("ordered", ordered)):
        state = program.init()
        step = program.step.lower(state, jax.device_put(batch, program.batch_sharding)).compile()
        moved[name] = pipeline_traffic(step.as_text(), program.mesh)
        if name == "ordered":  # the state holds the layers permuted; its natural view is the init
            stacked = jax.device_get(state.params["layers"])
            init = jax.device_get(program.to_natural(state).params["layers"])
            jax.tree.map(lambda s, n: np.testing.assert_array_equal(s, n[np.asarray(order)]), stacked, init)
        state, metrics = step(state, jax.device_put(batch, program.batch_sharding))
        after[name] = (float(metrics["loss"]), jax.device_get(program.to_natural(state).params))
    print(f"\n{schedule} p=2 m={m}: bytes over pipeline per step {moved}")
    assert moved["natural"]["layers"] > 0 and moved["ordered"]["layers"] == 0, moved
    assert moved["ordered"]["step"] == moved["natural"]["step"], moved
    assert after["ordered"][0] == after["natural"][0]
    # The parameters within the degeneracy bounds (tests/support/reference.py), not bitwise: the two programs
    # are fused apart, and one Adam step turns last-bit gradient differences of tiny elements into
    # visible ones (measured under the suite's elemental emitter: 3e-4 of a leaf's largest element).
    assert max_relative_error(after["ordered"][1], after["natural"][1]) <= PARAM_RTOL
    assert l2_relative_error(after["ordered"][1], after["natural"][1]) <= PARAM_L2_RTOL


@pytest.mark.parametrize("schedule, v, layers, stored", [
    ("interleaved_1f1b", 2, 8, True),
    ("zb_v", 2, 8, True),
    ("dualpipev", 2, 8, True),
    ("1f1b", 1, 8, False),  # v = 1: the schedule's order is the natural one
    ("interleaved_1f1b", 2, 7, False),  # stacks replicated over pipeline: no layer moves either way
])
def test_the_plan_decides_the_order_and_the_cost_model_reads_it(schedule, v, layers, stored):
    """No compilation: the plan of a config (`make_plan`) stores interleaved and V layouts in the
    schedule's order, and the cost model then charges no per-step re-layout for them."""
    config = tiny.with_overrides(pipeline_config(num_hidden_layers=layers), {"pipeline": 2}, parallel=pp(schedule, 4, v))
    est = estimate(config, "h200", num_devices=2)
    assert est.layout.plan.pipeline.layers_in_schedule_order == stored
    if stored:
        assert not est.layout.relays_layers
        assert est.layout.plan.pipeline.stored_order != tuple(range(layers))
