"""Values inside `jax.shard_map`: their specs over the manual axes and which manual axes they vary over.

Inside a shard_map with `check_vma`, a loop carry or a `lax.switch` branch result must keep one
type, so a value that starts replicated but becomes per-device is marked varying first
(`jax.lax.pcast(..., to="varying")`; jax 0.10 has no `pvary`). Outside shard_map every helper
here is the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over (jax 0.10's name for the old `.vma`)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def manual_axes() -> tuple:
    """The manual axes of the mesh being traced in (empty outside shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual)


def manual_spec(rules, names, manual) -> P:
    """The shard_map spec of a value with logical axis `names`: each name's mesh axes from the
    rules table, keeping only the `manual` ones (the others stay with the partitioner)."""
    entries = []
    for name in names:
        axes = () if name is None else tuple(a for a in rules.table[name] if a in manual)
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*entries)


def mark_varying(x, axes):
    """`x` marked varying over `axes` too (those it already varies over are skipped)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_like(x, *refs):
    """`x` marked varying over every manual axis the refs vary over."""
    return mark_varying(x, frozenset().union(*(varying_axes(r) for r in refs)))


def vary_everywhere(x):
    """`x` marked varying over every manual axis of the current shard_map."""
    return mark_varying(x, manual_axes())


def sum_to(cotangent, primal):
    """Sums a cotangent over the manual axes its primal is invariant over (as JAX's own transpose
    of an implicit pvary does): e.g. weights replicated over `data` get the sum over `data`."""
    axes = varying_axes(cotangent) - varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(axes))) if axes else cotangent


def _widened_on_cpu(x) -> bool:
    return x.dtype in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "cpu"


def psum_wide(x, axes):
    """`jax.lax.psum(x, axes)`, summed in fp32 when `x` is 16-bit on CPU. XLA:CPU widens 16-bit
    all-reduces itself (AllReducePromotion), and inside a shard_map whose other axes stay with
    the partitioner the reduction body ends in a sharding annotation, which that pass cannot
    clone: compiling aborts the process ("Invalid binary instruction opcode copy"; bf16, pipeline
    2 x tensor 4, vocab "spread"). Summing in fp32 is what the pass would have done."""
    if _widened_on_cpu(x):
        return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
    return jax.lax.psum(x, axes)


def vary_everywhere_wide(x):
    """`vary_everywhere(x)`, whose transpose (a psum of the cotangent) runs in fp32 for 16-bit `x`
    on CPU, for the reason `psum_wide` gives."""
    if _widened_on_cpu(x):
        return vary_everywhere(x.astype(jnp.float32)).astype(x.dtype)
    return vary_everywhere(x)
