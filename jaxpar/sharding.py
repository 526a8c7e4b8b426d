"""Logical axis names → mesh axes: the one table every sharding in jaxpar comes from.

Models name array dimensions only logically. Parameters use `vocab, embed, heads, kv_heads,
head_dim, mlp, layers, norm`; activations use `batch, seq` and the `act_*` names. `Rules` maps each
name to a tuple of mesh axes (empty: replicated). A name missing from the table, or a mesh axis
appearing twice in one array's spec, raises `ShardingRuleError` — never a silent fallback.

Two tables exist per config: one for parameters and one for optimizer state. They differ only in
where ZeRO puts the `data` axis (stage 1: optimizer state only; stage 3: both).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# The data-parallel axes of the batch: for dense layers, expert devices are more data replicas.
BATCH_AXES = ("data", "expert")
# The axis ZeRO shards parameters / optimizer state over, and the parameter dim it splits.
ZERO_AXIS = "data"


class ShardingRuleError(ValueError):
    """A logical name with no rule, or a mesh axis used twice in one array."""


@dataclass(frozen=True)
class Rules:
    """An immutable logical-name → mesh-axes table bound to a mesh."""

    mesh: Mesh
    table: dict  # name -> tuple[str, ...]

    def spec(self, names) -> P:
        used: dict[str, str] = {}
        entries = []
        for name in names:
            if name is None:
                entries.append(None)
                continue
            if name not in self.table:
                raise ShardingRuleError(f"logical axis {name!r} has no sharding rule (known: {sorted(self.table)})")
            axes = tuple(self.table[name])
            for axis in axes:
                if axis in used:
                    raise ShardingRuleError(
                        f"mesh axis {axis!r} used twice in one array: by {used[axis]!r} and {name!r} in {tuple(names)}"
                    )
                used[axis] = name
            entries.append(axes if len(axes) > 1 else (axes[0] if axes else None))
        return P(*entries)

    def sharding(self, names) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    def constrain(self, x, names):
        return jax.lax.with_sharding_constraint(x, self.sharding(names))

    def tree_shardings(self, logical_tree):
        """NamedShardings for a tree whose leaves are tuples of logical names."""
        return jax.tree.map(self.sharding, logical_tree, is_leaf=_is_names)

    def without(self, *mesh_axes) -> "Rules":
        """The same table with `mesh_axes` removed everywhere (e.g. a layer gathered for FSDP)."""
        table = {k: tuple(a for a in v if a not in mesh_axes) for k, v in self.table.items()}
        return Rules(self.mesh, table)


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def constrain(rules: Rules | None, x, names):
    """`rules.constrain` that is the identity when running without a mesh (rules None)."""
    return x if rules is None else rules.constrain(x, names)


def kv_heads_shardable(num_kv_heads: int, tensor: int) -> bool:
    """KV heads split over `tensor` when they divide evenly; otherwise they are replicated (Megatron)."""
    return num_kv_heads % tensor == 0


def build_table(config, mesh: Mesh, *, zero_on_params: bool) -> dict:
    parallel, model = config.parallel, config.model
    tensor = mesh.shape["tensor"]
    kv = ("tensor",) if kv_heads_shardable(model.num_key_value_heads, tensor) else ()
    zero = (ZERO_AXIS,) if zero_on_params else ()
    return {
        # parameters
        "vocab": ("tensor",),
        "embed": zero,
        "norm": (),
        "heads": ("tensor",),
        "kv_heads": kv,
        "head_dim": (),
        "mlp": ("tensor",),
        # Stacked layers split into contiguous pipeline stages (the engine reshapes them).
        "layers": ("pipeline",) if mesh.shape["pipeline"] > 1 else (),
        "expert": ("expert",),
        # activations
        "batch": BATCH_AXES,
        "seq": (),
        "act_seq": ("tensor",) if parallel.sequence_parallel else (),
        "act_embed": (),
        "act_heads": ("tensor",),
        "act_kv_heads": kv,
        "act_mlp": ("tensor",),
        "act_vocab": ("tensor",),
    }


def param_rules(config, mesh: Mesh) -> Rules:
    return Rules(mesh, build_table(config, mesh, zero_on_params=config.parallel.zero_stage >= 3))


def opt_state_rules(config, mesh: Mesh) -> Rules:
    return Rules(mesh, build_table(config, mesh, zero_on_params=config.parallel.zero_stage >= 1))
