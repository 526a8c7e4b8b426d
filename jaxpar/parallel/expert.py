"""Expert parallelism: send each routed token to the device holding its expert, compute, send back.

Routing groups are sequences. Every decision that depends on other tokens (the sort by expert,
a token's slot in its expert's buffer, which tokens overflow a capacity) is taken within one row of
the batch, in token order. So results, dropped tokens included, never depend on how the batch is
split over devices, and the partitioner never has to move rows between data-parallel devices.

Where the collectives are (mesh.expert = ep > 1): `moe_ffn` is called on the global [B, S, D]
activations. It regroups the batch as [outer, ep, inner] so the `expert` part of the batch
sharding is a dimension of its own, and enters a `jax.shard_map` that is manual over `expert`
only (`data` and `tensor` stay with the partitioner: rows stay data-sharded, the experts' hidden
dimension stays tensor-sharded). Inside, each device holds R = B / ep rows and E / ep experts:

  1. per row, sort the S·k (token, expert) assignments by expert (stable: token order);
  2. pack them into fixed-size send buffers, one block per destination device;
  3. `all_to_all` over `expert` (block j goes to device j; received blocks are indexed by source);
  4. run the local experts on what arrived;
  5. `all_to_all` back, pick each assignment's output out of the returned blocks, un-sort, and
     sum the k outputs of each token weighted by the router.

Two buffer layouts:
- capacity (`capacity` C > 0): [R, E, C, D], C slots per expert per row; assignments beyond C are
  dropped (their output is zero). Experts run as one batched matmul over their slots.
- dropless (`capacity` 0): [R, ep, M, D] with M = S·min(k, E/ep), the most assignments one row can
  send to one device, so nothing is ever dropped (dense worst-case buffers: the CPU backend has
  no `ragged_all_to_all`). Received rows stay sorted by expert; `jax.lax.ragged_dot` runs each
  expert on its own rows (rows past a block's count are padding and ignored).
With ep = 1 there is no shard_map and no collective: capacity mode uses the same buffers;
dropless runs `ragged_dot` directly on the sorted rows.

Not implemented: a `ragged_all_to_all` exchange (sending only the filled part of each block).
It is unimplemented on CPU, and its flat ragged leading axis would have to be local to a device,
which the rows are not while `data` is left to the partitioner.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

EXPERT_AXIS = "expert"


def capacity_per_expert(seq_len: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots each expert has for one sequence's tokens: ceil(S·k / E · factor), at most S
    (an expert never gets a token twice); 0 for dropless (factor 0)."""
    if factor <= 0:
        return 0
    return max(1, min(seq_len, math.ceil(seq_len * top_k / num_experts * factor)))


def dropped_assignments(ids, num_experts: int, capacity: int):
    """How many (token, expert) assignments overflow their expert's capacity, over the batch."""
    if capacity == 0:
        return jnp.zeros((), jnp.float32)
    per_row = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.int32), axis=(1, 2))  # [B, E]
    return jnp.sum(jnp.maximum(per_row - capacity, 0)).astype(jnp.float32)


def moe_ffn(x, ids, weights, experts, *, num_experts: int, capacity: int, rules):
    """Sum over k of weights[..., k] · expert_{ids[..., k]}(x), for x [B, S, D], ids / weights
    [B, S, k]; `experts` = (gate [E, D, F], up [E, D, F], down [E, F, D]) SwiGLU weights.
    `rules` None (no mesh) or a mesh with expert = 1: no collectives."""
    ep = 1 if rules is None else rules.mesh.shape[EXPERT_AXIS]
    local = _capacity_local if capacity else _dropless_local
    if ep == 1:
        return local(x, ids, weights, *experts, num_experts=num_experts, capacity=capacity, ep=1, exchange=None)

    to_groups, from_groups, rows_spec = _expert_major_rows(rules, x.shape[0], ep)

    def per_device(x, ids, weights, *experts):
        # [outer, 1, inner, ...] -> [outer·inner, ...]: this device's rows (outer stays data-sharded).
        flat = lambda a: a.reshape((-1,) + a.shape[3:])  # noqa: E731
        out = local(flat(x), flat(ids), flat(weights), *experts, num_experts=num_experts, capacity=capacity,
                    ep=ep, exchange=_all_to_all)
        return out.reshape(x.shape)

    out = jax.shard_map(
        per_device,
        mesh=rules.mesh,
        in_specs=(rows_spec,) * 3 + (P(EXPERT_AXIS),) * 3,
        out_specs=rows_spec,
        axis_names={EXPERT_AXIS},
    )(to_groups(x), to_groups(ids), to_groups(weights), *experts)
    return from_groups(out)


def _all_to_all(a):
    """Block j of axis 1 goes to expert device j; received blocks are indexed by source device."""
    return jax.lax.all_to_all(a, EXPERT_AXIS, 1, 1, tiled=True)


def _expert_major_rows(rules, batch: int, ep: int):
    """[B, ...] <-> [outer, ep, inner, ...] where the batch sharding ("data", "expert") becomes one
    mesh axis per dimension, so the shard_map's in/out specs (expert only) match where rows
    already are and entering it moves no data."""
    axes = tuple(rules.table["batch"])
    if EXPERT_AXIS not in axes:
        raise ValueError(f"expert parallelism needs 'expert' among the batch axes, got {axes}")
    i = axes.index(EXPERT_AXIS)
    before, after = axes[:i], axes[i + 1 :]
    outer = math.prod(rules.mesh.shape[a] for a in before)
    inner = batch // (outer * ep)
    sharding = lambda ndim: NamedSharding(  # noqa: E731
        rules.mesh, P(before or None, EXPERT_AXIS, after or None, *([None] * (ndim - 1)))
    )

    def to_groups(a):
        grouped = a.reshape((outer, ep, inner) + a.shape[1:])
        return jax.lax.with_sharding_constraint(grouped, sharding(a.ndim))

    def from_groups(a):
        return a.reshape((batch,) + a.shape[3:])

    return to_groups, from_groups, P(None, EXPERT_AXIS)


# ---- Per-device computation (rows R, all E experts' routing, E / ep local experts) ----


def _gather_rows(a, index):
    """a [R, N, D], index [R, M] -> [R, M, D]."""
    return jnp.take_along_axis(a, index[..., None], axis=1)


def _sort_by_expert(x, ids, num_experts: int):
    """Per row, the S·k assignments sorted by expert (stable, so earlier tokens first):
    (token rows [R, N, D], sort order [R, N], expert of each sorted row [R, N], counts [R, E],
    first sorted row of each expert [R, E]), N = S·k."""
    rows, k = ids.shape[0], ids.shape[-1]
    flat = ids.reshape(rows, -1)
    order = jnp.argsort(flat, axis=-1, stable=True)
    expert = jnp.take_along_axis(flat, order, axis=-1)
    counts = jnp.sum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=1)
    starts = jnp.cumsum(counts, axis=-1) - counts
    return _gather_rows(x, order // k), order, expert, counts, starts


def _pack(sorted_rows, starts, counts, slots: int):
    """[R, G, slots, D] blocks: block g holds sorted rows starts[g] .. starts[g] + counts[g] - 1
    (at most `slots`), zeros after."""
    rows, n, d = sorted_rows.shape
    slot = jnp.arange(slots)
    source = jnp.minimum(starts[..., None] + slot, n - 1)  # [R, G, slots]
    filled = slot < counts[..., None]
    packed = _gather_rows(sorted_rows, source.reshape(rows, -1)).reshape(source.shape + (d,))
    return jnp.where(filled[..., None], packed, 0)


def _combine(sorted_out, order, weights):
    """Un-sorts per-assignment outputs [R, N, D] and sums each token's k outputs, weighted."""
    rows, seq, k = weights.shape
    per_assignment = _gather_rows(sorted_out, jnp.argsort(order, axis=-1))
    per_assignment = per_assignment.reshape(rows, seq, k, -1)
    return jnp.einsum("rskd,rsk->rsd", per_assignment, weights.astype(per_assignment.dtype))


def _capacity_local(x, ids, weights, gate, up, down, *, num_experts, capacity, ep, exchange):
    rows, seq, d = x.shape
    n = ids.shape[-1] * seq
    local_experts = num_experts // ep
    sorted_rows, order, expert, counts, starts = _sort_by_expert(x, ids, num_experts)
    buffers = _pack(sorted_rows, starts, counts, capacity)  # [R, E, C, D]
    buffers = buffers.reshape(rows, ep, local_experts, capacity, d)
    if exchange is not None:
        buffers = exchange(buffers)  # [R, source device, local expert, C, D]
    hidden = jax.nn.silu(jnp.einsum("rpecd,edf->rpecf", buffers, gate)) * jnp.einsum("rpecd,edf->rpecf", buffers, up)
    out = jnp.einsum("rpecf,efd->rpecd", hidden, down)
    if exchange is not None:
        out = exchange(out)  # back home: [R, destination device, local expert, C, D] = [R, E, C, D]
    out = out.reshape(rows, num_experts * capacity, d)
    rank = jnp.arange(n) - jnp.take_along_axis(starts, expert, axis=-1)  # place within its expert
    kept = rank < capacity
    sorted_out = _gather_rows(out, expert * capacity + jnp.minimum(rank, capacity - 1))
    return _combine(jnp.where(kept[..., None], sorted_out, 0), order, weights)


def _dropless_local(x, ids, weights, gate, up, down, *, num_experts, capacity, ep, exchange):
    del capacity
    rows, seq, d = x.shape
    k = ids.shape[-1]
    sorted_rows, order, expert, counts, starts = _sort_by_expert(x, ids, num_experts)
    if exchange is None:
        sorted_out = _ragged_swiglu(sorted_rows[:, None], counts[:, None], gate, up, down)[:, 0]
        return _combine(sorted_out, order, weights)

    local_experts = num_experts // ep
    slots = seq * min(k, local_experts)  # a row's worst case for one device: every token, min(k, E/ep) times
    device_counts = counts.reshape(rows, ep, local_experts).sum(-1)  # [R, ep]
    device_starts = starts[:, ::local_experts]
    send = _pack(sorted_rows, device_starts, device_counts, slots)  # [R, ep, M, D]
    received = exchange(send)
    received_counts = exchange(counts.reshape(rows, ep, local_experts))  # [R, source, local expert]
    out = exchange(_ragged_swiglu(received, received_counts, gate, up, down)).reshape(rows, ep * slots, d)
    device = expert // local_experts
    place = jnp.arange(seq * k) - jnp.take_along_axis(device_starts, device, axis=-1)
    return _combine(_gather_rows(out, device * slots + place), order, weights)


# lhs [R, P, M, D] with rows sorted by group along M; rhs [G, D, F]; group sizes [R, P, G].
_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([3], [1]), ([], [])), lhs_ragged_dimensions=[2], rhs_group_dimensions=[0]
)


def _ragged_swiglu(rows, sizes, gate, up, down):
    """Each expert's SwiGLU on its own contiguous rows; rows past sum(sizes) give zeros."""
    dot = lambda a, w: jax.lax.ragged_dot_general(a, w, sizes, _RAGGED, preferred_element_type=a.dtype)  # noqa: E731
    return dot(jax.nn.silu(dot(rows, gate)) * dot(rows, up), down)
