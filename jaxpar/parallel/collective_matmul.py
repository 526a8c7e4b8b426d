"""Collective matmul (`parallel.collective_matmul="permutes"`): under tensor + sequence parallelism,
the all-gather before each column-parallel projection and the reduce-scatter after each row-parallel
one decomposed into exchanges of sequence chunks (collective-permutes), each in flight while a partial
matmul that does not need it runs.

Column-parallel (q, k, v, gate, up): x [B, S/t, K] (the sequence over `tensor`) times w [K, N/t].
Each rank multiplies the chunks it holds while sending them on, and ends with all S rows of its N/t
columns. Row-parallel (o, down): x [B, S, K/t] times w [K/t, N], summed over `tensor` and split by
sequence: each rank sends partial sums for other ranks' chunks while it computes the next ones, and
ends with its own chunk's sum. With a power-of-two t the exchanges double (gather) or halve (scatter)
a run of chunks with rank r xor d, d = 1, 2, 4 ..: log2 t permutes per exchange (2 at t = 4, 3 at
t = 8) where a ring takes t − 1; another t uses the ring. Same bytes as the collective either way.

The gradients are written out (custom VJPs): a gather's input gradient is the scatter of the same
exchange and vice versa, and each weight's gradient is one matmul over the gathered sequence, where
plain autodiff of the loops summed t full-size single-chunk buffers and ran t small matmuls per weight.

Both are `jax.shard_map` code, manual over every mesh axis the operands name except those already
manual (the pipeline engine's); the weights enter split over `tensor` alone, so ZeRO-3's gather of
them stays the partitioner's. Sums run in a different order from XLA's reduce-scatter: equal to the
plain path to rounding (tests/parallel/test_collective_matmul.py). `parallel.collective_matmul="xla"`
leaves the plain path to XLA's GPU windowed einsum instead (`XLA_FLAGS`, see `xla_flags`).
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp

from jaxpar.axes import PIPELINE, TENSOR
from jaxpar.manual import manual_axes, manual_spec
from jaxpar.sharding import RESIDUAL

KEY = "parallel.collective_matmul"
# none: the partitioner's gathers and scatters; permutes: this module's exchanges; xla: the plain path,
# which XLA's GPU compiler decomposes itself (its windowed einsum) when these flags are set.
MODES = ("none", "permutes", "xla")
XLA_GPU_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0", "--xla_gpu_multi_streamed_windowed_einsum=true")


def problems(config, mesh: dict, facts, family_name: str, platform: str | None) -> list[str]:
    """One line per reason `parallel.collective_matmul` cannot run as set (`platform`: the devices'
    "cpu" / "gpu" / .., None when not known yet)."""
    parallel, mode = config.parallel, config.parallel.collective_matmul
    if mode not in MODES:
        return [f"{KEY}={mode!r} is not one of {', '.join(MODES)}"]
    if mode == "none" or mesh[TENSOR] == 1:
        return []
    if not parallel.sequence_parallel:
        return [f"{KEY}={mode!r} decomposes sequence parallelism's gathers; set parallel.sequence_parallel=True (or {KEY}='none')"]
    errors = []
    if mode == "xla":
        given = {flag.split("=")[0] for flag in os.environ.get("XLA_FLAGS", "").split()}
        if platform == "gpu" and XLA_GPU_FLAGS[0].split("=")[0] not in given:  # the threshold turns it on
            errors.append(f"{KEY}='xla' needs XLA_FLAGS='{' '.join(XLA_GPU_FLAGS)}' set before JAX starts (XLA's windowed einsum)")
        return errors
    if mesh.get(PIPELINE, 1) > 1:
        errors.append(f"{KEY}='permutes' is not supported with mesh.pipeline > 1 yet")
    if config.train.get("fp8", "none") != "none":
        errors.append(f"{KEY}='permutes' is not supported with train.fp8={config.train.fp8!r} yet")
    if facts.is_moe or facts.flops_latent:
        errors.append(f"{KEY}='permutes' runs the dense attention and MLP projections; {family_name}'s experts or latent "
                      f"attention do not have it yet (set it 'none')")
    return errors


def _dot(x, w, contract: int):
    """x [B, s, K...] @ w [K..., N...] → [B, s, N...]."""
    dims = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract)))
    return jax.lax.dot_general(x, w, (dims, ((), ())), preferred_element_type=x.dtype)


def _dot_t(dy, w, contract: int):
    """dy [B, s, N...] @ w [K..., N...] transposed → [B, s, K...]: `_dot`'s input gradient."""
    dims = (tuple(range(2, dy.ndim)), tuple(range(contract, w.ndim)))
    return jax.lax.dot_general(dy, w, (dims, ((), ())), preferred_element_type=dy.dtype)


def _dot_w(x, dy, w):
    """`_dot`'s weight gradient from the whole sequence at once, x [B, S, K...] and dy [B, S, N...]."""
    return jax.lax.dot_general(x, dy, (((0, 1), (0, 1)), ((), ())), preferred_element_type=x.dtype).astype(w.dtype)


def _ring(t: int):
    return [(i, (i + 1) % t) for i in range(t)]


def _swap(t: int, d: int):
    return [(i, i ^ d) for i in range(t)]


def _chunks(x, first, count: int, n: int):
    """Sequence chunks first .. first + count − 1 of x (chunks of n positions)."""
    return jax.lax.dynamic_slice_in_dim(x, first * n, count * n, axis=1)


def _put(x, block, first, n: int):
    return jax.lax.dynamic_update_slice_in_dim(x, block, first * n, axis=1)


def _gather(x):
    """All-gathers x [B, n, ...] over `tensor` by permutes: (the gathered [B, t·n, ...], the blocks in
    the order they arrive, each with the index of its first chunk), so that each block's matmul can
    run while the next exchange is in flight. A power-of-two t doubles the run of chunks it holds
    each step (log2 t exchanges with rank r xor d); another t passes chunks round a ring (t − 1)."""
    t, r, n = jax.lax.axis_size(TENSOR), jax.lax.axis_index(TENSOR), x.shape[1]
    full = _put(jnp.zeros((x.shape[0], t * n, *x.shape[2:]), x.dtype), x, r, n)
    blocks, d = [(x, r)], 1
    while d < t:
        if t & (t - 1):
            block, first = jax.lax.ppermute(blocks[-1][0], TENSOR, _ring(t)), (r - d) % t
            d += 1
        else:  # r's aligned run of d chunks, to the rank holding the run beside it
            block = jax.lax.ppermute(_chunks(full, r & ~(d - 1), d, n), TENSOR, _swap(t, d))
            first, d = (r ^ d) & ~(d - 1), 2 * d
        blocks.append((block, first))
        full = _put(full, block, first, n)
    return full, blocks


def _scatter(part, n: int):
    """Reduce-scatters over `tensor` by permutes: `part(first, count)` is this rank's partial sum for
    `count` sequence chunks of n positions from chunk `first`; returns chunk r's sum over the ranks.
    Each exchange is in flight while the partials for the next are computed. A power-of-two t halves
    the run it answers for each step (log2 t exchanges); another t passes an accumulator round a ring."""
    t, r = jax.lax.axis_size(TENSOR), jax.lax.axis_index(TENSOR)
    if t & (t - 1):
        acc = part((r - 1) % t, 1)  # the accumulator held at step s ends on rank r − 1 − s
        for step in range(1, t):
            acc = jax.lax.ppermute(acc, TENSOR, _ring(t)) + part((r - 1 - step) % t, 1)
        return acc
    d, summed = t // 2, None  # summed: what the partners sent, for r's aligned run of 2d chunks
    send = part((r ^ d) & ~(d - 1), d)
    while True:
        incoming = jax.lax.ppermute(send, TENSOR, _swap(t, d))  # the partner's sums for r's run of d
        summed = incoming if summed is None else _chunks(summed, jnp.where(r & d, d, 0), d, n) + incoming
        d //= 2
        if not d:
            return summed + part(r, 1)
        send = _chunks(summed, jnp.where(r & d, 0, d), d, n) + part((r ^ d) & ~(d - 1), d)


def _gather_matmul_fwd(x, ws, contract):
    full, blocks = _gather(x)
    outs = []
    for w in ws:
        out = jnp.zeros((*full.shape[:2], *w.shape[contract:]), x.dtype)
        for block, first in blocks:
            out = _put(out, _dot(block, w, contract), first, x.shape[1])
        outs.append(out)
    return tuple(outs), (full, ws)


def _gather_matmul_bwd(contract, residuals, dys):
    full, ws = residuals
    n = full.shape[1] // jax.lax.axis_size(TENSOR)
    dx = _scatter(lambda first, count: sum(_dot_t(_chunks(dy, first, count, n), w, contract) for dy, w in zip(dys, ws)), n)
    return dx.astype(full.dtype), tuple(_dot_w(full, dy, w) for dy, w in zip(dys, ws))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_matmul(x, ws, contract: int):
    """Local: x [B, n, K] (this rank's chunk) times each w [K, N/t] → [B, t·n, N/t] each. The chunks
    travel once for all the weights (q, k, v: one exchange, not three). Its gradient is written
    out: the input's as the reduce-scatter of the same exchanges, the weights' as one matmul each
    over the gathered input (plain autodiff summed t full-size one-chunk buffers per input and
    ran t small weight matmuls)."""
    return _gather_matmul_fwd(x, ws, contract)[0]


def _matmul_scatter_fwd(x, w, contract):
    n = x.shape[1] // jax.lax.axis_size(TENSOR)
    return _scatter(lambda first, count: _dot(_chunks(x, first, count, n), w, contract), n), (x, w)


def _matmul_scatter_bwd(contract, residuals, dy):
    x, w = residuals
    full, blocks = _gather(dy)
    dx = jnp.zeros(x.shape, x.dtype)
    for block, first in blocks:
        dx = _put(dx, _dot_t(block, w, contract).astype(x.dtype), first, dy.shape[1])
    return dx, _dot_w(x, full, w)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_scatter(x, w, contract: int):
    """Local: x [B, t·n, K/t] → [B, n, N], this rank's sequence chunk summed over the ranks; its
    gradient the gather of the output gradient's chunks, each block's matmul beside the next exchange."""
    return _matmul_scatter_fwd(x, w, contract)[0]


_gather_matmul.defvjp(_gather_matmul_fwd, _gather_matmul_bwd)
_matmul_scatter.defvjp(_matmul_scatter_fwd, _matmul_scatter_bwd)


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
