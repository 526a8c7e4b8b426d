"""FP8 matmuls (`jaxpar.kernels.fp8`) against fp32, within the formats' rounding bound.

The bound, per output element. Scaled by s (x / s fills the format), a normal value rounds to the
nearest of 2^m values per binade: relative error at most u = 2^-(m+1), u = 2^-4 for e4m3 (m = 3),
2^-3 for e5m2 (m = 2). Below the smallest normal (2^-6 e4m3, 2^-14 e5m2) the grid is uniform,
spacing 2^-9 (e4m3) or 2^-16 (e5m2): absolute error at most half of it, times s. So each operand
element a is stored as ã with |ã − a| ≤ e_a = max(u_a |a|, δ_a s_a), and for c = Σ_k a_k b_k

    |c̃ − c| ≤ Σ_k (e_a |b| + |a| e_b + e_a e_b)_k      (E_a @ |B| + |A| @ E_B + E_a @ E_b)

plus the fp32 accumulation (n · 2^-24 · Σ|a||b|, covered by a 1e-5 relative slack). `s` is the
scale the recipe uses: per tensor (tensorwise, delayed) or per row / column over the contracted
dims (rowwise), so the bound is computed with each recipe's own scales. Forward: x, w in e4m3.
Backward: dx = dy wᵀ with dy in e5m2, w in e4m3; dw = xᵀ dy likewise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.kernels.fp8 import E4M3, E5M2, Scaling, fp8_project

FORMAT = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}  # (u, δ): relative, subnormal half-spacing
MAX = {E4M3: 448.0, E5M2: 57344.0}


def _errors(a, fmt, reduce):
    """e_a: each element's worst rounding error, with the scale over the dims `reduce` (None: all)."""
    u, delta = FORMAT[fmt]
    scale = np.max(np.abs(a), axis=reduce, keepdims=reduce is not None) / MAX[fmt]
    return np.maximum(u * np.abs(a), delta * scale)


def _bound(a, b, fmts, rowwise):
    """Elementwise bound on |ã b̃ − a b| for a [M, K] @ b [K, N]."""
    ea = _errors(a, fmts[0], 1 if rowwise else None)
    eb = _errors(b, fmts[1], 0 if rowwise else None)
    slack = 1e-5 * (np.abs(a) @ np.abs(b))
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb + slack


def _operands():
    rng = np.random.default_rng(0)
    # Rows of very different sizes (as activations have), so rowwise differs from tensorwise.
    x = rng.standard_normal((48, 32)) * np.exp(rng.uniform(-3, 3, (48, 1)))
    w = rng.standard_normal((32, 24)) * 0.05
    dy = rng.standard_normal((48, 24)) * 1e-3 * np.exp(rng.uniform(-2, 2, (48, 1)))
    return (np.asarray(t, np.float32) for t in (x, w, dy))


RECIPES = {"tensorwise": Scaling.TENSOR, "rowwise": Scaling.ROW, "delayed": Scaling.HISTORY}


def _run(scaling, x, w, dy):
    """(y, dx, dw) of the FP8 projection; delayed starts from an empty history (scales from now)."""
    history = jnp.zeros((5, 3), jnp.float32) if scaling is Scaling.HISTORY else None

    def f(x, w):
        return fp8_project(x, w, 1, scaling, history) if history is not None else fp8_project(x, w, 1, scaling)

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    return (np.asarray(t) for t in (y, *vjp(jnp.asarray(dy))))


@pytest.mark.parametrize("recipe", RECIPES)
def test_error_within_rounding_bound(recipe):
    x, w, dy = _operands()
    y, dx, dw = _run(RECIPES[recipe], x, w, dy)
    rowwise = recipe == "rowwise"
    checks = {
        "y = x w": (y, x @ w, _bound(x, w, (E4M3, E4M3), rowwise)),
        "dx = dy wᵀ": (dx, dy @ w.T, _bound(dy, w.T, (E5M2, E4M3), rowwise)),
        "dw = xᵀ dy": (dw, x.T @ dy, _bound(x.T, dy, (E4M3, E5M2), rowwise)),
    }
    for name, (got, exact, bound) in checks.items():
        excess = np.abs(got - exact) / bound
        assert np.max(excess) <= 1.0, f"{recipe} {name}: error {np.max(excess):.2f}x the rounding bound"
        # Not vacuous: the FP8 result is not the fp32 one.
        assert np.max(np.abs(got - exact)) > 1e-4 * np.max(np.abs(exact)), f"{recipe} {name}: no rounding at all?"


def test_delayed_uses_history_and_reports_amaxes():
    """With a history the scales come from its max (not the tensors); the history's cotangent holds
    the amaxes of x, w and dy in row 0 and their weight 1 in row 1. (Stale scales clip: the price
    of delayed scaling when amaxes grow.)"""
    x, w, dy = _operands()
    history = np.zeros((5, 3), np.float32)
    amax = [np.max(np.abs(t)) for t in (x, w, dy)]
    history[2] = [a / 16 for a in amax]  # an old amax 16x smaller: today's largest values clip at 448
    f = lambda x, w, h: fp8_project(x, w, 1, Scaling.HISTORY, h)  # noqa: E731
    y, vjp = jax.vjp(f, *(jnp.asarray(t) for t in (x, w, history)))
    _, _, dh = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(dh)[:2], [amax, [1, 1, 1]], rtol=1e-6)
    assert not np.any(np.asarray(dh)[2:])
    clipped = np.max(np.abs(np.asarray(y) - x @ w))
    fresh = np.max(np.abs(next(_run(Scaling.HISTORY, x, w, dy)) - x @ w))
    assert clipped > 2 * fresh


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_quantize_dequantize_form_within_rounding_bound(recipe):
    """The experts' form: each operand rounded within e_a (its own scales), the output's cotangent
    within e5m2's, and the operands' gradients passed straight through (not rounded again)."""
    from jaxpar.kernels.fp8 import fp8_input, fp8_output, fp8_weight

    x, w, dy = _operands()
    scaling, rowwise = RECIPES[recipe], recipe == "rowwise"
    experts = np.stack([w, 3 * w])  # [E, K, N], contracted over dim 1
    for got, exact, fmt, reduce in (
        (fp8_input(jnp.asarray(x), scaling), x, E4M3, 1 if rowwise else None),
        (fp8_weight(jnp.asarray(experts), scaling, 1), experts, E4M3, 1 if rowwise else None),
    ):
        assert np.all(np.abs(np.asarray(got) - exact) <= _errors(exact, fmt, reduce) * (1 + 1e-6))
        assert np.any(np.asarray(got) != exact)
    _, vjp = jax.vjp(lambda a: fp8_output(fp8_input(a, scaling) @ jnp.asarray(w), scaling), jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(dy))
    rounded = np.asarray(jax.vjp(lambda t: fp8_output(t, scaling), jnp.asarray(dy))[1](jnp.asarray(dy))[0])
    assert np.all(np.abs(rounded - dy) <= _errors(dy, E5M2, 1 if rowwise else None) * (1 + 1e-6))
    np.testing.assert_allclose(np.asarray(dx), rounded @ w.T, rtol=1e-5, atol=1e-9)
