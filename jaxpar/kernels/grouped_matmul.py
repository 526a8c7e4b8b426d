"""Grouped matmul for MoE experts: rows grouped, each group times its own weight matrix.

`grouped_matmul(x [M, K], w [G, K, N], sizes [G], impl, tile)` gives row i of group g as x[i] @ w[g],
where group g holds the `sizes[g]` rows after those of groups < g; rows at or past sum(sizes) are
padding (zero on the tiled path, unspecified on the ragged one: callers never read them).

- GPU / TPU ("ragged", tile 1): `jax.lax.ragged_dot`, XLA's grouped GEMM, on groups packed back to back.
- CPU ("tiled"): `ragged_dot` is lowered there as a dense matmul of every row with every group's
  weight (G times the work: with it the bench Mixtral took ~126 s a step on 2 cores, ~9.5 s with a
  loop). So the caller lays the rows out with every group padded to a multiple of `tile` rows
  (`group_tile`, `layout_rows`; the MoE dispatch writes that layout with the gather it needs
  anyway), and each tile of rows belongs to one group: one loop over the layout's tiles, each a
  [tile, K] x [K, N] matmul written in place, skipped (`cond`) past the last group. A
  `custom_vjp` gives the backward as two more such loops: the input gradient with each group's
  weight contracted on its last axis (a plain dot, no transposed copy of the weights) and the
  weight gradient summed tile by tile.
  Why this layout: the earlier loop cut packed rows into pieces at tile and group boundaries, and
  each piece's row masks, partial-output sums and transposes cost as much as its matmul. The bench
  MoE's experts (64 of 512 -> 128, 16,384 skewed rows; SwiGLU forward + backward under remat, 5
  alternating rounds) took 712-805 ms that way and 558-623 ms this way; the same SwiGLU as dense
  matmuls over all rows at once takes 251-296 ms. Not taken: a loop per group (its weights sliced
  once, the tiles in an inner loop) was ~8% faster at kernel level, but its trip counts are
  dynamic, out of reach of the compiled-HLO accounting (`jaxpar.analysis.program.hlo_flops`); the whole
  SwiGLU in one forward and one backward loop was no faster in the step (`scripts/bench.py moe` 0.52 vs 0.50).

`grouped_matmul_pair(x, w1, w2, sizes)` runs two weights over the same rows (the experts' gate
and up) as one grouped matmul: on CPU one loop over [K, 2N] tiles beats two over [K, N].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.manual import sum_to, vary_like

TILE = 128


def resolve_impl(impl: str | None) -> str:
    """impl: "ragged" | "tiled" | None (ragged on GPU/TPU, tiled on CPU)."""
    return impl or ("tiled" if jax.default_backend() == "cpu" else "ragged")


def group_tile(impl: str, rows: int, groups: int) -> int:
    """Rows each group is padded to a multiple of in the layout `grouped_matmul` reads: 1 for the
    ragged path; for the tiled one the largest power of two in [8, TILE] at most rows / (2·groups),
    so that the padding adds at most half the rows (the bench MoE: 16,384 rows, 64 groups: 128)."""
    if impl == "ragged":
        return 1
    tile = 8
    while tile < TILE and 2 * tile * 2 * groups <= rows:
        tile *= 2
    return tile


def layout_rows(rows: int, groups: int, tile: int) -> int:
    """Static rows of a layout holding `rows` grouped rows, each group padded to a multiple of
    `tile`: at most ceil(rows / tile) + groups - 1 tiles (one partly filled per group)."""
    if tile == 1:
        return rows
    return (-(-rows // tile) + groups - 1) * tile


def grouped_matmul(x, w, sizes, impl: str | None = None, tile: int = 1):
    """x [M, K] grouped by `sizes` [G] (on the tiled path each a multiple of `tile`, and M too),
    w [G, K, N] -> [M, N]."""
    if resolve_impl(impl) == "ragged":
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)
    if x.shape[0] % tile:
        raise ValueError(f"grouped_matmul: {x.shape[0]} rows are not a multiple of the tile {tile}")
    return _tiled(x, w, sizes.astype(jnp.int32), tile)


def grouped_matmul_pair(x, w1, w2, sizes, impl: str | None = None, tile: int = 1):
    """[M, N, 2]: x @ w1 and x @ w2 per group (w1, w2 [G, K, N]) as one grouped matmul over their
    columns interleaved, [G, K, N·2] (interleaved, not concatenated, so that an N sharded over a
    mesh axis stays sharded without an exchange). On CPU one tiled loop instead of two: the bench
    MoE's experts, SwiGLU forward + backward under remat, took 750-1045 ms with gate and up as two
    loops and 650-780 ms as one, in alternating rounds (measured on the earlier piece loop).
    The stacked weights are rebuilt in the backward, not kept for it (kept, they were one more
    [G, K, 2N] per layer: +6% to +29% peak memory in the MoE fidelity cases without remat)."""
    return _pair(x, w1, w2, sizes, impl, tile).reshape(*x.shape[:-1], -1, 2)


def _interleaved_product(x, w1, w2, sizes, impl, tile):
    return grouped_matmul(x, jnp.stack([w1, w2], axis=-1).reshape(*w1.shape[:-1], -1), sizes, impl, tile)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _pair(x, w1, w2, sizes, impl, tile):
    return _interleaved_product(x, w1, w2, sizes, impl, tile)


def _pair_fwd(x, w1, w2, sizes, impl, tile):
    return _pair(x, w1, w2, sizes, impl, tile), (x, w1, w2, sizes)


def _pair_bwd(impl, tile, residuals, dy):
    x, w1, w2, sizes = residuals
    # The pullback's own forward output is unused and XLA drops it: the gradient of the pair
    # compiles to 3 tiled loops (forward, dx, dw), as one grouped matmul's does.
    _, pullback = jax.vjp(lambda x, w1, w2: _interleaved_product(x, w1, w2, sizes, impl, tile), x, w1, w2)
    return (*pullback(dy), None)


_pair.defvjp(_pair_fwd, _pair_bwd)


def _loop_over_tiles(rows: int, sizes, tile: int, init, step, *refs):
    """Runs `step(acc, first_row, group) -> acc` for each tile of the layout that holds a group's
    rows. The loop's trip count is static (every tile of the layout; those past the last group
    are skipped by the `cond`), so compiled HLO counts its matmuls and collectives per tile."""
    ends = jnp.cumsum(sizes) // tile  # the tile each group ends before
    index = jnp.arange(rows // tile, dtype=jnp.int32)
    # Not jnp.searchsorted: it fails inside shard_map on device-varying values (jax 0.10.2).
    group = jnp.minimum(jnp.sum(index[:, None] >= ends[None, :], axis=-1), sizes.shape[0] - 1)
    active = index < ends[-1]

    def body(t, acc):
        return jax.lax.cond(active[t], lambda acc: step(acc, t * tile, group[t]), lambda acc: acc, acc)

    return jax.lax.fori_loop(0, rows // tile, body, vary_like(init, sizes, *refs))


def _rows(a, first, tile):
    return jax.lax.dynamic_slice_in_dim(a, first, tile)


def _forward(x, w, sizes, tile, transposed=False):
    """x @ w[g] per tile, or with `transposed` x @ w[g]ᵀ (the input gradient: the dot contracts
    the weight's last axis; XLA:CPU runs that form as fast as the plain one, measured)."""

    def step(out, first, group):
        wg = jax.lax.dynamic_index_in_dim(w, group, keepdims=False)
        y = jnp.matmul(_rows(x, first, tile), wg.T if transposed else wg, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), first, 0)

    width = w.shape[1] if transposed else w.shape[2]
    return _loop_over_tiles(x.shape[0], sizes, tile, jnp.zeros((x.shape[0], width), x.dtype), step, x, w)


def _weight_grad(x, dy, sizes, tile, num_groups):
    def step(dw, first, group):
        # x_tileᵀ · dy_tile as one dot contracting the rows (Eigen's dot_general on XLA:CPU): per
        # tile as fast as materialising x_tileᵀ first for YNNPACK's plain dot, without the copy.
        piece = jax.lax.dot_general(
            _rows(x, first, tile), _rows(dy, first, tile), (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        current = jax.lax.dynamic_index_in_dim(dw, group, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(dw, current + piece, group, 0)

    init = jnp.zeros((num_groups, x.shape[1], dy.shape[1]), jnp.float32)  # summed over tiles: fp32
    return _loop_over_tiles(x.shape[0], sizes, tile, init, step, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x, w, sizes, tile):
    return _forward(x, w, sizes, tile)


def _tiled_fwd(x, w, sizes, tile):
    return _forward(x, w, sizes, tile), (x, w, sizes)


def _tiled_bwd(tile, residuals, dy):
    x, w, sizes = residuals
    dx = _forward(dy, w, sizes, tile, transposed=True)
    dw = _weight_grad(x, dy, sizes, tile, w.shape[0]).astype(w.dtype)
    return sum_to(dx, x), sum_to(dw, w), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
