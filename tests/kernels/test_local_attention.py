"""The band kernel for sliding layers (`jaxpar.kernels.local_attention`) beside the full kernel it
replaces, on what the definition tests (tests/models/test_attention_pattern.py, which runs it against
torch in float64) leave out: sequences that are no multiple of a tile, every tile count, a window
equal to the span (the band's far edge), and that it never forms a [T, T] array — the work it skips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.kernels.attention import patterned_attention
from jaxpar.kernels.local_attention import banded_attention, patterned_or_banded

B, T, H, K, D = 2, 37, 4, 2, 8


def _inputs():
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, T, H, D))
    k, v = (jax.random.normal(key, (B, T, K, D)) for key in keys[1:3])
    sinks = jax.random.normal(keys[3], (H,))
    segments = np.ones((B, T), np.int32)
    segments[0, 10:25], segments[0, 25:], segments[1, 30:] = 2, 3, 0  # three documents; padding at row 1's end
    return q, k, v, sinks, jnp.asarray(segments)


def _value_and_grads(attention, q, k, v, sinks):
    loss = lambda q, k, v, s: jnp.sum(jnp.sin(attention(q, k, v, s)))  # noqa: E731
    return attention(q, k, v, sinks), jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)


@pytest.mark.parametrize("tiles", [1, 2, 3, 8])
@pytest.mark.parametrize("window", [1, 5, 8])
def test_band_equals_the_full_kernel(window, tiles):
    q, k, v, sinks, segments = _inputs()
    span = 8
    band = lambda q, k, v, s: banded_attention(q, k, v, segments, window, span, s, 5.0, 0.3, tiles=tiles)  # noqa: E731
    whole = lambda q, k, v, s: patterned_attention(q, k, v, segments, window, s, 5.0, 0.3)  # noqa: E731
    (out, grads), (want, want_grads) = _value_and_grads(band, q, k, v, sinks), _value_and_grads(whole, q, k, v, sinks)
    np.testing.assert_allclose(out, want, atol=1e-6)
    for name, got, expected in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, expected, atol=2e-6, err_msg=name)
    np.testing.assert_allclose(grads[3], want_grads[3], atol=1e-5, err_msg="sinks")


def test_the_band_never_forms_the_whole_score_matrix():
    """Every array of the band's forward and backward is smaller than T × T per head: the skipped work."""
    t, span = 256, 16
    q = jnp.zeros((1, t, 2, 8))
    k = v = jnp.zeros((1, t, 1, 8))
    loss = lambda q, k, v: jnp.sum(banded_attention(q, k, v, None, span, span)) # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    whole = jax.jit(jax.grad(lambda q, k, v: jnp.sum(patterned_attention(q, k, v, None, span)), argnums=(0, 1, 2)))
    assert f"{t}x{t}x" in whole.lower(q, k, v).as_text(), "the full kernel's scores are T x T (the check can see them)"
    assert f"{t}x{t}x" not in text and f"x{t}x{t}" not in text


def test_layers_of_both_kinds_take_their_own_branch():
    """Under `lax.cond` a full layer (window 0) and a window wider than the span take the full kernel."""
    q, k, v, sinks, segments = _inputs()
    for window in (0, 3, 8, 9, 40):
        got = jax.jit(lambda w: patterned_or_banded(q, k, v, segments, w, 8, sinks))(jnp.int32(window))
        np.testing.assert_allclose(got, patterned_attention(q, k, v, segments, window, sinks), atol=1e-6, err_msg=str(window))
