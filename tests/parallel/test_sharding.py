"""The logical-axis rules table: strict, and the single source of every sharding."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import models
from jaxpar.mesh import make_mesh
from jaxpar.sharding import Rules, ShardingRuleError
from jaxpar.train.setup import build
from tests.support import tiny


def rules_for(mesh, **parallel):
    config = tiny.with_overrides(tiny.llama(), mesh, parallel=parallel)
    program = build(config, jax.devices())
    return config, program.rules, program.opt_rules


def test_unmapped_logical_name_is_an_error():
    _, rules, _ = rules_for({"data": 8})
    with pytest.raises(ShardingRuleError, match="'vocabulary' has no sharding rule"):
        rules.spec(("vocabulary", "embed"))


def test_mesh_axis_used_twice_is_an_error_even_when_size_one():
    mesh = make_mesh(dict(data=8, tensor=1, pipeline=1, context=1, expert=1))
    rules = Rules(mesh, {"a": ("tensor",), "b": ("tensor",)})
    with pytest.raises(ShardingRuleError, match="used twice"):
        rules.spec(("a", "b"))


def test_megatron_layout_and_zero3():
    config, rules, opt_rules = rules_for({"data": 2, "tensor": 4}, zero_stage=3)
    logical = models.logical_axes(config.model)
    specs = jax.tree.map(rules.spec, logical, is_leaf=lambda x: isinstance(x, tuple))
    attention, mlp = specs["layers"]["attention"], specs["layers"]["mlp"]
    assert attention["q"] == P(None, "data", "tensor", None)  # column-parallel over heads
    assert attention["o"] == P(None, "tensor", None, "data")  # row-parallel
    assert attention["k"] == P(None, "data", None, None)  # 2 KV heads < tensor 4: replicated
    assert mlp["gate"] == P(None, "data", "tensor") and mlp["down"] == P(None, "tensor", "data")
    assert specs["embed"]["weight"] == P("tensor", "data")  # vocab-parallel embedding
    assert specs["lm_head"]["weight"] == P("data", "tensor")  # vocab-parallel head
    assert rules.spec(("batch", "act_seq", "act_embed")) == P(("data", "expert"), None, None)


def test_zero1_shards_only_optimizer_state_and_sp_shards_sequence():
    _, rules, opt_rules = rules_for({"data": 4, "tensor": 2}, zero_stage=1, sequence_parallel=True)
    assert rules.spec(("embed", "mlp")) == P(None, "tensor")
    assert opt_rules.spec(("embed", "mlp")) == P("data", "tensor")
    assert rules.spec(("batch", "act_seq", "act_embed")) == P(("data", "expert"), "tensor", None)


def test_plan_names_every_decision():
    from jaxpar.parallel.data import GradientStrategy

    config = tiny.with_overrides(tiny.llama({"grad_accum": 2}), {"data": 2, "tensor": 4}, parallel={"zero_stage": 1})
    plan = build(config, jax.devices()).plan
    assert plan.zero.shard_optimizer_state and not plan.zero.shard_params and plan.zero.stage == 1
    assert plan.tensor.kv_repeat == 2 and not plan.tensor.kv_heads_sharded  # 2 KV heads, tensor 4
    assert plan.gradient is GradientStrategy.PER_REPLICA and plan.pipeline is None
    zero3 = tiny.with_overrides(config, {"data": 8}, parallel={"zero_stage": 3})
    assert build(zero3, jax.devices()).plan.gradient is GradientStrategy.PLAIN  # FSDP reduces per microbatch
