"""The logical-axis rules table: strict, and the single source of every sharding."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import models
from jaxpar.mesh import make_mesh
from jaxpar.sharding import Rules, ShardingRuleError, opt_state_rules, param_rules
from tests.reference import with_overrides
from tests.test_degeneracy import tiny_config


def rules_for(mesh, **parallel):
    config = with_overrides(tiny_config(), mesh, parallel=parallel)
    return config, param_rules(config, make_mesh(config.mesh)), opt_state_rules(config, make_mesh(config.mesh))


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
