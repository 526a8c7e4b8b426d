"""Layer stacks stored in the schedule's order (`layout.storage_order`, `PipelineOptions.
layers_in_schedule_order`): every rank's stages are already in its storage block, so the engine
moves no layers — measured on the compiled program — and the loss and gradients are the natural
order's, permuted.

Bytes over `pipeline` per training step, from the compiled HLO (`analysis.compiled.
pipeline_traffic`: every collective whose devices differ only along `pipeline`, times its
executions): the layer exchange (collective-permutes outside the schedule's scan: parameters
before it, gradients after) and the rest (activations, gradients and the vocab-parallel
all-reduces, inside it). Storage in the
schedule's order removes the first and leaves the second unchanged; the natural order is the
positive control (it does move layers for these schedules).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis.compiled import pipeline_traffic
from jaxpar.axes import PIPELINE
from jaxpar.parallel.pipeline.layout import stage_layout, storage_order, to_stages
from jaxpar.parallel.pipeline.table import modular_stages
from jaxpar.parallel.pipeline.vshape import v_stages
from jaxpar.train.setup import build
from jaxpar.train.step import loss_and_grads
from tests import tiny
from tests.reference import synthetic_batches
from tests.test_pipeline import pipeline_config, pp


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


def permute_layers(params, order):
    return {**params, "layers": jax.tree.map(lambda a: jnp.take(a, jnp.asarray(order), axis=0), params["layers"])}


def program_and_step(schedule, m, v, stored: bool):
    config = tiny.with_overrides(pipeline_config(), {"pipeline": 2}, parallel=pp(schedule, m, v))
    program = build(config, jax.devices()[:2])
    opts = program.opts
    pipe = dataclasses.replace(opts.plan.pipeline, layers_in_schedule_order=stored)
    opts = dataclasses.replace(opts, plan=dataclasses.replace(opts.plan, pipeline=pipe))
    step = jax.jit(lambda p, b: loss_and_grads(p, b, model_config=config.model, opts=opts))
    return config, program, pipe, step


@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule, m, v", [("interleaved_1f1b", 4, 2), ("zb_v", 2, 2)])
def test_schedule_order_moves_no_layers_and_trains_the_same(schedule, m, v):
    config, program, _, natural = program_and_step(schedule, m, v, stored=False)
    _, _, pipe, ordered = program_and_step(schedule, m, v, stored=True)
    order = pipe.stored_order
    assert sorted(order) == list(range(8)) and order != tuple(range(8))
    params = program.init().params
    batch = jax.device_put(synthetic_batches(config, 1)[0], program.batch_sharding)
    moved = {}
    for name, step, p in (("natural", natural, params), ("ordered", ordered, permute_layers(params, order))):
        text = step.lower(p, batch).compile().as_text()
        moved[name] = pipeline_traffic(text, program.mesh)
    print(f"\n{schedule} p=2 m={m}: bytes over pipeline per step {moved}")
    assert moved["natural"]["layers"] > 0 and moved["ordered"]["layers"] == 0, moved
    assert moved["ordered"]["step"] == moved["natural"]["step"], moved
    loss, grads, _ = natural(params, batch)
    loss_o, grads_o, _ = ordered(permute_layers(params, order), batch)
    assert float(loss_o) == float(loss)
    back = np.argsort(order)  # storage position of each layer
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b)[back], np.asarray(a), rtol=1e-6, atol=1e-7),
                 grads["layers"], grads_o["layers"])
