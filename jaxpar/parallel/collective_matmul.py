"""Collective matmul (`parallel.collective_matmul`): under tensor + sequence parallelism, the
all-gather before each column-parallel projection and the reduce-scatter after each row-parallel one
decomposed into `tensor` steps of collective-permutes, each overlapping a partial matmul.

Column-parallel (q, k, v, gate, up): x [B, S/t, K] (the sequence over `tensor`) times w [K, N/t].
Each rank computes the product of the sequence chunk it holds, passes that chunk to the next rank
while the matmul runs, and after t steps holds all S rows of its N/t columns — the all-gather's bytes
moved as t − 1 permutes with nothing waiting on a whole gather.

Row-parallel (o, down): x [B, S, K/t] times w [K/t, N], to be summed over `tensor` and split by
sequence. An accumulator for one sequence chunk travels the ring: each rank adds its partial product
for that chunk and passes it on; after t steps rank r holds chunk r's sum — the reduce-scatter's bytes
as t − 1 permutes, each next partial matmul independent of the permute in flight.

Both are `jax.shard_map` code, manual over every mesh axis the operands name except those already
manual (the pipeline engine's); the weights enter split over `tensor` alone, so ZeRO-3's gather of
them stays the partitioner's. Sums run in a different order from XLA's reduce-scatter: equal to the
plain path to rounding (tests/parallel/test_collective_matmul.py). On GPU XLA's own windowed einsum
(`--xla_gpu_threshold_for_windowed_einsum_mib`) is the alternative, a compiler flag, not this code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.axes import TENSOR
from jaxpar.manual import manual_axes, manual_spec
from jaxpar.sharding import RESIDUAL


def _dot(x, w, contract: int):
    dims = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract)))
    return jax.lax.dot_general(x, w, (dims, ((), ())), preferred_element_type=x.dtype)


def _ring(t: int):
    return [(i, (i + 1) % t) for i in range(t)]


def _gather_matmul(x, ws, contract: int):
    """Local: x [B, n, K] (this rank's chunk) times each w [K, N/t] → [B, t·n, N/t] each, chunk j of the
    sequence from rank j. The chunk travels once for all the weights (q, k, v: one ring, not three)."""
    t, r = jax.lax.axis_size(TENSOR), jax.lax.axis_index(TENSOR)
    n = x.shape[1]
    outs = [jnp.zeros((x.shape[0], t * n, *w.shape[contract:]), x.dtype) for w in ws]
    chunk = x
    for step in range(t):
        # The next chunk is sent before this one's matmuls: nothing ties the two together.
        incoming = jax.lax.ppermute(chunk, TENSOR, _ring(t)) if step < t - 1 else None
        owner = (r - step) % t  # the rank this chunk started on: its place in the sequence
        outs = [jax.lax.dynamic_update_slice_in_dim(out, _dot(chunk, w, contract), owner * n, axis=1)
                for out, w in zip(outs, ws)]
        chunk = incoming
    return tuple(outs)


def _matmul_scatter(x, w, contract: int):
    """Local: x [B, t·n, K/t] → [B, n, N], this rank's sequence chunk summed over the ranks."""
    t, r = jax.lax.axis_size(TENSOR), jax.lax.axis_index(TENSOR)
    n = x.shape[1] // t
    acc = None
    for step in range(t):
        chunk = (r - 1 - step) % t  # the accumulator this rank holds now ends on rank `chunk`
        part = _dot(jax.lax.dynamic_slice_in_dim(x, chunk * n, n, axis=1), w, contract)
        acc = part if acc is None else acc + part
        if step < t - 1:
            acc = jax.lax.ppermute(acc, TENSOR, _ring(t))
    return acc


def _manual(rules) -> frozenset:
    return frozenset(rules.mesh.axis_names) - frozenset(manual_axes())


def column_parallel(x, ws, rules, w_names, out_names):
    """x [B, S, K] (the residual's layout: sequence over `tensor`) @ each of `ws` ([K, ...], output dims
    over `tensor`; `w_names` their logical names), each out in its `out_names` layout: a tuple."""
    manual = _manual(rules)
    in_specs = (manual_spec(rules, RESIDUAL, manual), tuple(manual_spec(rules, n, {TENSOR}) for n in w_names))
    out_specs = tuple(manual_spec(rules, n, manual) for n in out_names)
    return jax.shard_map(lambda x, ws: _gather_matmul(x, ws, 1), mesh=rules.mesh, in_specs=in_specs,
                         out_specs=out_specs, axis_names=manual, check_vma=False)(x, tuple(ws))


def row_parallel(x, w, rules, x_names, w_names, contract: int = 1):
    """x (`x_names`: contracted dims over `tensor`) @ w, summed over `tensor`, in the residual's layout."""
    manual = _manual(rules)
    in_specs = (manual_spec(rules, x_names, manual), manual_spec(rules, w_names, {TENSOR}))
    return jax.shard_map(lambda x, w: _matmul_scatter(x, w, contract), mesh=rules.mesh, in_specs=in_specs,
                         out_specs=manual_spec(rules, RESIDUAL, manual), axis_names=manual, check_vma=False)(x, w)
