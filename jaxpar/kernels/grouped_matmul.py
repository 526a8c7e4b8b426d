"""Grouped matmul for MoE experts: rows sorted by group, each group times its own weight matrix.

`grouped_matmul(x [M, K], w [G, K, N], sizes [G])` gives row i of group g as x[i] @ w[g]; rows at
or past sum(sizes) are padding (zero on the tiled path, unspecified on the ragged one: callers
never read them).

- GPU / TPU: `jax.lax.ragged_dot`, XLA's grouped GEMM.
- CPU: `ragged_dot` is lowered there as a dense matmul of every row with every group's weight
  (G times the work: with it the bench Mixtral took ~126 s a step on 2 cores, ~9.5 s with this). The
  tiled path cuts the rows into tiles of `TILE` and each tile into pieces at group boundaries;
  there are at most M/TILE + G + 1 pieces, and each costs one [TILE, K] x [K, N] matmul, so the
  work is close to the sum of the groups' sizes. A `custom_vjp` gives the backward as two more
  such loops (dx with the transposed weights, dw accumulated piece by piece).

`grouped_matmul_pair(x, w1, w2, sizes)` runs two weights over the same rows (the experts' gate
and up) as one grouped matmul: on CPU each loop's per-piece slicing and masking costs about as
much as its matmul, so one loop over [K, 2N] pieces beats two over [K, N].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.manual import sum_to, vary_like

TILE = 128


def grouped_matmul(x, w, sizes, impl: str | None = None):
    """impl: "ragged" | "tiled" | None (ragged on GPU/TPU, tiled on CPU)."""
    impl = impl or ("tiled" if jax.default_backend() == "cpu" else "ragged")
    if impl == "ragged":
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)
    tile = min(TILE, -(-x.shape[0] // 8) * 8)
    return _tiled(x, w, sizes.astype(jnp.int32), tile)


def grouped_matmul_pair(x, w1, w2, sizes, impl: str | None = None):
    """[M, N, 2]: x @ w1 and x @ w2 per group (w1, w2 [G, K, N]) as one grouped matmul over their
    columns interleaved, [G, K, N·2] (interleaved, not concatenated, so that an N sharded over a
    mesh axis stays sharded without an exchange). On CPU one tiled loop instead of two: the bench
    MoE's experts (64 of 512 -> 128, 16,384 skewed rows), SwiGLU forward + backward under remat,
    took 750-1045 ms with gate and up as two loops and 650-780 ms as one, in alternating rounds.
    The stacked weights are rebuilt in the backward, not kept for it (kept, they were one more
    [G, K, 2N] per layer: +6% to +29% peak memory in the MoE fidelity cases without remat)."""
    return _pair(x, w1, w2, sizes, impl).reshape(*x.shape[:-1], -1, 2)


def _interleaved_product(x, w1, w2, sizes, impl):
    return grouped_matmul(x, jnp.stack([w1, w2], axis=-1).reshape(*w1.shape[:-1], -1), sizes, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _pair(x, w1, w2, sizes, impl):
    return _interleaved_product(x, w1, w2, sizes, impl)


def _pair_fwd(x, w1, w2, sizes, impl):
    return _pair(x, w1, w2, sizes, impl), (x, w1, w2, sizes)


def _pair_bwd(impl, residuals, dy):
    x, w1, w2, sizes = residuals
    # The pullback's own forward output is unused and XLA drops it: the gradient of the pair
    # compiles to 3 tiled loops (forward, dx, dw), as one grouped matmul's does.
    _, pullback = jax.vjp(lambda x, w1, w2: _interleaved_product(x, w1, w2, sizes, impl), x, w1, w2)
    return (*pullback(dy), None)


_pair.defvjp(_pair_fwd, _pair_bwd)


def _pieces(sizes, padded_rows: int, tile: int):
    """Rows [begin, end) of each piece, its group and tile, and whether it has any real rows.
    Piece boundaries are the tile starts, the group starts and the end of the real rows."""
    total = jnp.sum(sizes)
    starts = jnp.cumsum(sizes) - sizes
    tile_starts = jnp.arange(0, padded_rows, tile, dtype=jnp.int32)
    begin = jnp.sort(jnp.concatenate([tile_starts, starts, total[None]]))
    end = jnp.concatenate([begin[1:], jnp.array([padded_rows], jnp.int32)])
    # The last group starting at or before `begin` (empty groups share a start with the next one).
    # Not jnp.searchsorted: it fails inside shard_map on device-varying values (jax 0.10.2).
    group = jnp.sum(begin[:, None] >= starts[None, :], axis=-1) - 1
    tile_index = jnp.minimum(begin // tile, padded_rows // tile - 1)
    active = (begin < end) & (begin < total)
    return begin, end, group, tile_index, active


def _in_piece(first_row, begin, end, tile):
    rows = first_row + jnp.arange(tile)
    return ((rows >= begin) & (rows < end))[:, None]


def _loop_over_pieces(x, sizes, tile, init, step, *refs):
    """Runs `step(acc, rows [tile, K] masked to the piece, first_row, group) -> acc` per active piece."""
    init = vary_like(init, x, sizes, *refs)
    padded = -(-x.shape[0] // tile) * tile
    x = jnp.pad(x, ((0, padded - x.shape[0]), (0, 0)))
    begin, end, group, tile_index, active = _pieces(sizes, padded, tile)

    def body(p, acc):
        def run(acc):
            first = tile_index[p] * tile
            rows = jax.lax.dynamic_slice_in_dim(x, first, tile)
            rows = jnp.where(_in_piece(first, begin[p], end[p], tile), rows, 0)
            return step(acc, rows, first, group[p])

        return jax.lax.cond(active[p], run, lambda acc: acc, acc)

    return jax.lax.fori_loop(0, begin.shape[0], body, init), padded


def _forward(x, w, sizes, tile):
    def step(out, rows, first, group):
        y = jnp.matmul(rows, jax.lax.dynamic_index_in_dim(w, group, keepdims=False), preferred_element_type=jnp.float32)
        y = y.astype(out.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, first, tile) + y, first, 0)

    padded = -(-x.shape[0] // tile) * tile
    out, _ = _loop_over_pieces(x, sizes, tile, jnp.zeros((padded, w.shape[-1]), x.dtype), step, w)
    return out[: x.shape[0]]


def _weight_grad(x, dy, sizes, tile, num_groups):
    padded = -(-x.shape[0] // tile) * tile
    dy = jnp.pad(dy, ((0, padded - dy.shape[0]), (0, 0)))

    def step(dw, rows, first, group):
        # rowsᵀ materialised first (behind a barrier, so that XLA does not fold the transpose
        # back into the dot): the canonical [K, tile]·[tile, N] dot takes XLA:CPU's fast path, the
        # transposed one Eigen's (fine-grained experts, 64 of [512, 128], 16384 rows: the weight
        # gradient dots were Eigen dot_generals, 2.1 of the 8.5 s the experts took per step in the
        # profile of `scripts/bench_moe.py`; after, YNNPACK fusions).
        rows_t = jax.lax.optimization_barrier(rows.T)
        piece = jnp.matmul(rows_t, jax.lax.dynamic_slice_in_dim(dy, first, tile), preferred_element_type=jnp.float32)
        current = jax.lax.dynamic_index_in_dim(dw, group, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(dw, current + piece, group, 0)

    init = jnp.zeros((num_groups, x.shape[1], dy.shape[1]), jnp.float32)  # summed over pieces: fp32
    return _loop_over_pieces(x, sizes, tile, init, step, dy)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x, w, sizes, tile):
    return _forward(x, w, sizes, tile)


def _tiled_fwd(x, w, sizes, tile):
    return _forward(x, w, sizes, tile), (x, w, sizes)


def _tiled_bwd(tile, residuals, dy):
    x, w, sizes = residuals
    dx = _forward(dy, jnp.swapaxes(w, 1, 2), sizes, tile)
    dw = _weight_grad(x, dy, sizes, tile, w.shape[0]).astype(w.dtype)
    return sum_to(dx, x), sum_to(dw, w), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
