"""Projections `x [..., K] @ w [K, N]` whose weight gradient XLA:CPU runs on its fast matmul path.

Autodiff's weight gradient xᵀ·dy contracts the token dimensions, the major dimensions of both
operands. XLA:CPU then transposes dy ([T, N] → [N, T], fused into the elementwise backward before
it) and hands the dot to Eigen rather than to its faster YNNPACK path. Here the backward
materialises xᵀ once ([K, B, S], behind an optimization barrier so that XLA cannot fold the
transpose back into the dot) and computes the canonical [K, T]·[T, N] dot, which YNNPACK takes;
dx = dy·wᵀ is what autodiff computes. The values are the same sums (fp32: equal to ~1e-7).
Measured in the closing report of the performance issue (bench MLP forward + backward) and by
`scripts/bench.py`; compared with autodiff by
`tests/kernels/test_cpu_kernels.py::test_project_matches_einsum`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.kernels.fp8 import fp8_project


def project(x, w, contract: int = 1, *, splits_sequence: bool = False, fp8=None, history=None):
    """Contracts the last `contract` dims of x with the first `contract` dims of w (e.g. x [B, S, D]
    with w [D, H, Dh] → [B, S, H, Dh]). On CPU through `dense`; elsewhere, or when the run splits
    activations along the sequence (`ParallelPlan.splits_sequence`), a plain dot_general: there
    each projection's materialised xᵀ was all-gathered on its own (q, k and v: three gathers
    where autodiff shares one; tensor traffic +14% on data 2 x tensor 4 with SP). `fp8` (a
    `jaxpar.kernels.fp8.Scaling`): the FP8 GEMMs of `fp8_project` instead (`history`: its amax
    history, delayed scaling)."""
    if fp8 is not None:
        return fp8_project(x, w, contract, fp8, history)
    if jax.default_backend() != "cpu" or splits_sequence:
        dims = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract)))
        return jax.lax.dot_general(x, w, (dims, ((), ())), preferred_element_type=x.dtype)
    inner = math.prod(w.shape[:contract])
    out = dense(x.reshape(*x.shape[: x.ndim - contract], inner), w.reshape(inner, -1))
    return out.reshape(*x.shape[: x.ndim - contract], *w.shape[contract:])


def _matmul(x, w, out_dtype):
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=out_dtype)


@jax.custom_vjp
def dense(x, w):
    """x [..., K] @ w [K, N] in x's dtype."""
    return _matmul(x, w, x.dtype)


def _dense_fwd(x, w):
    return _matmul(x, w, x.dtype), (x, w)


def _dense_bwd(residuals, dy):
    x, w = residuals
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())), preferred_element_type=x.dtype)
    # xᵀ keeps x's leading dims ([K, B, S], not [K, B·S]): merging a batch dim with a sequence
    # dim split over `context` (or any split minor dim) made the partitioner all-gather x.
    x_t = jax.lax.optimization_barrier(jnp.moveaxis(x, -1, 0))
    lead = tuple(range(x.ndim - 1))
    dims = ((tuple(d + 1 for d in lead), lead), ((), ()))
    dw = jax.lax.dot_general(x_t, dy.astype(x.dtype), dims, preferred_element_type=w.dtype)
    return dx.astype(x.dtype), dw.astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)
