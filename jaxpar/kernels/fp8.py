"""FP8 matmuls: e4m3 forward operands, e5m2 cotangents, fp32 accumulation (`train.fp8`, `jaxpar.fp8`).

`fp8_project` is `jaxpar.kernels.dense.project` with each GEMM written as quantize → dot on FP8
operands with an fp32 result → scale, the form XLA's GPU GEMM rewriter turns into cuBLASLt FP8
GEMMs (on CPU, XLA converts the operands back and runs an fp32 dot: emulation, same values).
Its custom VJP runs the two backward GEMMs the same way, the cotangent quantized to e5m2:
dx = dy · wᵀ and dw = xᵀ · dy, each operand re-scaled along its own non-contracted dims (rowwise
needs that: the forward's per-token scales of x lie along dw's contracted dim).

Scales (`Scaling`): `tensor` one per operand, amax over the whole tensor; `row` one per row /
column, amax over the contracted dims (torchao's rowwise); `history` one per operand from
previous steps' amaxes (delayed scaling), the current amaxes reported back through the history's
gradient slot (`jaxpar.models.state`). scale = amax / max(format), x / scale rounded to the format.

An amax must be the same on every mesh. Under the SPMD partitioner a jnp.max over a sharded array
is already global; inside a `jax.shard_map` (pipeline, expert, context) it is per device, so every
reduction that spans split dims is followed by a `pmax` over the manual axes other than
`pipeline` (whose ranks hold other layers). Rowwise amaxes over a contracted feature dim need none
(feature dims are split over `tensor`, never manual); over tokens (dw's scales) they do.

`qdq` / `quantize_cotangent` are the quantize-dequantize form for matmuls this file does not run
(the experts' grouped matmuls): the operands rounded to FP8 and scaled back, the dot in the compute
dtype (the pattern Flax's Fp8DotGeneralOp emits and XLA's rewriter also matches).
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import get_fp8_max, quantize

from jaxpar.axes import PIPELINE
from jaxpar.manual import manual_axes, mark_varying, varying_axes

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2  # cotangents: 2 mantissa bits, max 57344 (more range for gradients)


class Scaling(enum.Enum):
    TENSOR = "per_tensor"
    ROW = "per_row"
    HISTORY = "from_history"


# Rows of an `fp8_project` history's gradient slot: the observed amaxes (x, w, dy) and their weight.
OBSERVED, WEIGHT = 0, 1


def global_max(amax):
    """`amax` reduced over the manual mesh axes but `pipeline` (identity outside shard_map)."""
    axes = tuple(a for a in manual_axes() if a != PIPELINE)
    if not axes:
        return amax
    return jax.lax.pmax(mark_varying(amax, axes), axes)


def amax_of(x, reduce: tuple | None, tokens: bool):
    """fp32 max |x| over the dims `reduce` (None: all), kept as size-1 dims; global when the
    reduction spans dims split over manual axes (all dims, or token dims: `tokens`)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=reduce, keepdims=reduce is not None)
    return global_max(amax) if reduce is None or tokens else amax


def scale_for(amax, fmt):
    """amax / max(fmt): x / scale fills the format; 1 where amax is 0 or not finite."""
    fine = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(fine, amax / get_fp8_max(fmt, jnp.float32), 1.0)


def quantized(x, fmt, scale):
    return quantize(x.astype(jnp.float32), fmt, scale, jnp.float32)


def scaled_dot(a, b, contract_a: tuple, contract_b: tuple, fmts, scaling: Scaling, *, tokens=(False, False), scales=None):
    """fp32 a · b contracting `contract_a` with `contract_b` (no batch dims), both operands
    quantized (`fmts`: their formats) with `scaling`'s scales — or the given `scales` (scalars).
    `tokens`: whether each operand's contracted dims are token dims (rowwise amaxes then global)."""
    free = lambda x, c: tuple(d for d in range(x.ndim) if d not in c)  # noqa: E731
    if scales is None:
        if scaling is Scaling.ROW:
            scales = tuple(scale_for(amax_of(x, c, t), f) for x, c, t, f in zip((a, b), (contract_a, contract_b), tokens, fmts))
        else:
            scales = tuple(scale_for(amax_of(x, None, False), f) for x, f in zip((a, b), fmts))
    qa, qb = (quantized(x, f, s) for x, f, s in zip((a, b), fmts, scales))
    out = jax.lax.dot_general(qa, qb, ((contract_a, contract_b), ((), ())), preferred_element_type=jnp.float32)
    sa, sb = scales
    if sa.ndim:  # rowwise: the output is [free dims of a, free dims of b]; each scale along its own
        sa, sb = jnp.squeeze(sa, contract_a), jnp.squeeze(sb, contract_b)
        sa = sa.reshape(sa.shape + (1,) * len(free(b, contract_b)))
    return out * sa * sb


def _dims(x, w, contract: int):
    k = tuple(range(x.ndim - contract, x.ndim))
    return k, tuple(range(contract))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_project(x, w, contract: int, scaling: Scaling, history=None):
    """x [..., K...] @ w [K..., N...] (the last `contract` dims of x with the first of w) in FP8,
    in x's dtype. `history` [H + 1, 3] (`Scaling.HISTORY` only): rows 0 .. H-1 the amaxes of x, w
    and the cotangent of earlier steps; the cotangent it gets back holds this call's amaxes in row
    `OBSERVED` and 1 in row `WEIGHT` (summed like any gradient, their ratio is the mean amax)."""
    return _forward(x, w, contract, scaling, history)[0]


def _history_scales(history):
    """Scales (x, w, dy) from the amax history (0 where no step has run yet: then None)."""
    amax = jnp.max(history[:-1].astype(jnp.float32), axis=0)
    return tuple(scale_for(amax[i], f) for i, f in enumerate((E4M3, E4M3, E5M2))), amax


def _forward(x, w, contract, scaling, history):
    kx, kw = _dims(x, w, contract)
    scales = None
    if scaling is Scaling.HISTORY:
        (sx, sw, _), amax = _history_scales(history)
        # Before the first step the history is empty (zeros): scale by the tensors in hand.
        now = tuple(amax_of(t, None, False) for t in (x, w))
        sx = jnp.where(amax[0] > 0, sx, scale_for(now[0], E4M3))
        sw = jnp.where(amax[1] > 0, sw, scale_for(now[1], E4M3))
        scales = (sx, sw)
    out = scaled_dot(x, w, kx, kw, (E4M3, E4M3), scaling, scales=scales)
    return out.astype(x.dtype), scales


def _fwd(x, w, contract, scaling, history=None):
    out, scales = _forward(x, w, contract, scaling, history)
    return out, (x, w, history)


def _bwd(contract, scaling, residuals, dy):
    x, w, history = residuals
    n = w.ndim - contract  # output feature dims
    lead = x.ndim - contract  # token dims
    dy_features = tuple(range(dy.ndim - n, dy.ndim))
    w_features = tuple(range(contract, w.ndim))
    tokens = tuple(range(lead))
    dx_scales = dw_scales = None
    observed = None
    if scaling is Scaling.HISTORY:
        (sx, sw, sg), amax = _history_scales(history)
        now = [amax_of(t, None, False) for t in (x, w, dy)]
        sx, sw, sg = (jnp.where(amax[i] > 0, s, scale_for(now[i], f)) for i, (s, f) in enumerate(zip((sx, sw, sg), (E4M3, E4M3, E5M2))))
        dx_scales, dw_scales = (sg, sw), (sx, sg)
        observed = jnp.zeros(history.shape, jnp.float32).at[OBSERVED].set(jnp.stack(now)).at[WEIGHT].set(1.0)
    dx = scaled_dot(dy, w, dy_features, w_features, (E5M2, E4M3), scaling, scales=dx_scales)
    dw = scaled_dot(x, dy, tokens, tokens, (E4M3, E5M2), scaling, tokens=(True, True), scales=dw_scales)
    # The cotangent varies over what the history does (the pipeline marks layer leaves varying).
    d_history = None if history is None else mark_varying(observed.astype(history.dtype), varying_axes(history))
    return dx.astype(x.dtype), dw.astype(w.dtype), d_history


fp8_project.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def quantize_cotangent(y, scaling: Scaling):
    """y, whose cotangent is rounded to e5m2 (scaled per tensor, or per row over the last dim)."""
    return y


def _qc_fwd(y, scaling):
    return y, None


def _qc_bwd(scaling, _, dy):
    return (qdq(dy, E5M2, scaling),)


quantize_cotangent.defvjp(_qc_fwd, _qc_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def qdq(x, fmt, scaling: Scaling, contract: tuple | None = None):
    """x rounded to `fmt` and scaled back, in x's dtype: one scale (tensor, history), or per
    slice over the dims `contract` (row; default the last dim). Its gradient passes straight
    through (autodiff of the cast would round the cotangent to `fmt` unscaled)."""
    return _qdq(x, fmt, scaling, contract)


def _qdq_fwd(x, fmt, scaling, contract):
    return _qdq(x, fmt, scaling, contract), None


def _qdq_bwd(fmt, scaling, contract, _, g):
    return (g,)


qdq.defvjp(_qdq_fwd, _qdq_bwd)


def _qdq(x, fmt, scaling, contract):
    if scaling is Scaling.ROW:
        reduce = (x.ndim - 1,) if contract is None else contract
        scale = scale_for(amax_of(x, reduce, False), fmt)
    else:
        scale = scale_for(amax_of(x, None, False), fmt)
    return (quantized(x, fmt, scale).astype(jnp.float32) * scale).astype(x.dtype)


# The quantize-dequantize form, for matmuls run by other kernels (the experts' grouped matmuls and
# einsums): each is the identity when `scaling` is None. Delayed scaling has no history there and
# scales per tensor from the tensors in hand.


def fp8_input(x, scaling: Scaling | None):
    """An activation [..., K] about to be contracted over its last dim, rounded to e4m3."""
    return x if scaling is None else qdq(x, E4M3, scaling)


def fp8_weight(w, scaling: Scaling | None, contract: int):
    """A weight contracted over dim `contract`, rounded to e4m3 (rowwise: per slice over it)."""
    return w if scaling is None else qdq(w, E4M3, scaling, (contract,))


def fp8_output(y, scaling: Scaling | None):
    """A matmul's output, whose cotangent is rounded to e5m2."""
    return y if scaling is None else quantize_cotangent(y, scaling)
