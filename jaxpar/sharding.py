"""Logical axis names → mesh axes: the one table every sharding in jaxpar comes from.

Models name array dimensions only logically. Parameters use `vocab, embed, heads, kv_heads,
head_dim, mlp, layers, norm, experts, latent, depth, lora_rank`; activations use `batch, seq` and the `act_*` names. `Rules`
maps each name to a tuple of mesh axes (empty: replicated). A name missing from the table, or a
mesh axis appearing twice in one array's spec, raises `ShardingRuleError` — never a silent
fallback.

Two tables exist per run, both built from the parallel plan (`jaxpar.parallel.plan`): one for
parameters and activations, one for optimizer state. They differ only in where ZeRO puts its axes (`data`,
and with `parallel.zero_axes` also `context`; stage 1: optimizer state only; stage 3: both).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.axes import CONTEXT, EXPERT, PIPELINE, TENSOR

# The residual stream between blocks: [batch, sequence, embed].
RESIDUAL = ("batch", "act_seq", "act_embed")


class ShardingRuleError(ValueError):
    """A logical name with no rule, or a mesh axis used twice in one array."""


def is_logical_names(x) -> bool:
    """A leaf of a logical-names tree: a tuple of names (None for an unnamed dim)."""
    return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


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
        return jax.tree.map(self.sharding, logical_tree, is_leaf=is_logical_names)

    def without(self, *mesh_axes) -> Rules:
        """The same table with `mesh_axes` removed everywhere (e.g. a layer gathered for FSDP)."""
        table = {k: tuple(a for a in v if a not in mesh_axes) for k, v in self.table.items()}
        return Rules(self.mesh, table)

    def on(self, mesh) -> Rules:
        """The same table bound to another (e.g. a shard_map's abstract) mesh."""
        return Rules(mesh, self.table)


def constrain(rules: Rules | None, x, names):
    """`rules.constrain` that is the identity when running without a mesh (rules None)."""
    return x if rules is None else rules.constrain(x, names)


def rules_table(plan, *, zero_on_params: bool) -> dict:
    tensor, pipeline = plan.tensor, plan.pipeline
    zero = tuple(plan.zero.axes) if zero_on_params else ()
    # Context parallelism splits the sequence of every activation (and of the batch's tokens,
    # targets, positions) over `context`; sequence parallelism splits each shard over `tensor`.
    context = (CONTEXT,) if plan.context is not None else ()
    return {
        # parameters
        # Embedding / LM head rows also split over the pipeline ranks (`parallel.pipeline.vocab`).
        "vocab": (PIPELINE, TENSOR) if pipeline is not None and pipeline.vocab == "spread" else (TENSOR,),
        "embed": zero,
        "norm": (),
        "heads": (TENSOR,),
        "kv_heads": (TENSOR,) if tensor.kv_heads_sharded else (),
        "head_dim": (),
        "mlp": (TENSOR,),
        # Stacked layers split over pipeline when it divides them (`parallel.pipeline.layout`).
        "layers": (PIPELINE,) if pipeline is not None and pipeline.shard_layers else (),
        "experts": (EXPERT,),
        # A low-rank bottleneck (MLA's latents): small, replicated.
        "latent": (),
        # Stacked prediction modules after the layers (multi-token prediction): never staged.
        "depth": (),
        # LoRA adapters' inner rank dim (`jaxpar.models.lora`): small, replicated.
        "lora_rank": (),
        # activations
        "batch": tuple(plan.batch_axes),
        "seq": context,
        "act_seq": context + ((TENSOR,) if tensor.sequence_parallel else ()),
        "act_embed": (),
        "act_heads": (TENSOR,),
        "act_kv_heads": (TENSOR,),  # after `tensor.repeat_kv`, KV heads always divide over tensor
        "act_mlp": (TENSOR,),
        "act_vocab": (TENSOR,),
    }


def param_rules(plan, mesh: Mesh) -> Rules:
    return Rules(mesh, rules_table(plan, zero_on_params=plan.zero.shard_params))


def opt_state_rules(plan, mesh: Mesh) -> Rules:
    return Rules(mesh, rules_table(plan, zero_on_params=plan.zero.shard_optimizer_state))
