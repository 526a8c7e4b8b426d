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
        piece = jnp.matmul(rows.T, jax.lax.dynamic_slice_in_dim(dy, first, tile), preferred_element_type=jnp.float32)
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
