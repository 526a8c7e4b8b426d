"""cuDNN runs the layer patterns it can express: a sliding window, a score scale, documents.

`attend(..., "cudnn", ...)` hands a sliding layer to `jax.nn.dot_product_attention` with
`local_window_size` (W - 1, 0), a full layer without it, picked by a `lax.cond` on the layer's
traced window; sinks and soft-capping take the XLA path. On CPU what jaxpar hands cuDNN is checked
without one: the call is intercepted (it must ask for cuDNN) and run by jax's XLA implementation with
the same arguments, which must match `xla_attention` (the definition, autodiff) forward and backward
for layers of both kinds in one scan. On a GPU (`-m gpu`) real cuDNN is held to the XLA path in bf16.
The cost model follows: under attention_impl cudnn a model with sinks is priced as on the XLA path.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.models.attention_pattern import Pattern, attend, xla_attention

WINDOW, SEQ, SCALE = 5, 16, 6.0**-0.5  # SCALE: query_pre_attn_scalar 6 (head_dim 8)


def inputs(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, SEQ, 4, 8)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, SEQ, 2, 8)), dtype) for _ in range(2))
    # Row 0: documents of 9 and 7 tokens (windows shorter than both); row 1: 12 tokens, then padding.
    segments = jnp.asarray([[1] * 9 + [2] * 7, [1] * 12 + [0] * 4], jnp.int32)
    return q, k, v, segments


def over_layers(impl, windows, q, k, v, segments, cotangent):
    """Outputs of one layer per window in a scan (`lax.map`) and the gradients of <outputs, cotangent>."""

    def layers(q, k, v):
        def one(window):
            return attend(q, k, v, impl, segments, Pattern(window, None, None, SCALE, WINDOW))

        return jax.lax.map(one, windows)

    out, pull = jax.vjp(layers, q, k, v)
    return out, pull(cotangent)


@pytest.fixture
def intercepted(monkeypatch):
    """Each cuDNN call's local_window_size, the call run by jax's XLA implementation."""
    real, asked = jax.nn.dot_product_attention, []

    def on_cpu(*args, implementation=None, **kwargs):  # cuDNN's arguments, run where there is no cuDNN
        asked.append((implementation, kwargs.get("local_window_size")))
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_cpu)
    return asked


def test_cudnn_runs_sliding_and_full_layers_as_the_xla_path(intercepted):
    q, k, v, segments = inputs()
    windows = jnp.asarray([WINDOW, 0, WINDOW], jnp.int32)  # traced: a scan over layers of both kinds
    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal((3, *q.shape)), jnp.float32)
    got, got_grads = jax.jit(lambda *a: over_layers("cudnn", windows, *a))(q, k, v, segments, cotangent)
    # The cond traces both static kernels once: the sliding one with cuDNN's (W - 1, 0), the full one without.
    assert len(intercepted) == 2 and set(intercepted) == {("cudnn", None), ("cudnn", (WINDOW - 1, 0))}
    want, want_grads = jax.jit(lambda *a: over_layers("xla", windows, *a))(q, k, v, segments, cotangent)
    # The window matters at these shapes: a sliding layer differs from a full one.
    assert float(jnp.max(jnp.abs(want[0] - want[1]))) > 0.1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(got)[:, 1, 12:] == 0)  # padding rows give 0


def test_sinks_and_soft_capping_take_the_xla_path_and_say_so(intercepted, caplog):
    q, k, v, segments = inputs()
    sinks = jnp.linspace(-1.0, 1.0, 4)
    for pattern in (Pattern(jnp.int32(WINDOW), sinks, None, SCALE, WINDOW), Pattern(jnp.int32(WINDOW), None, 30.0, SCALE, WINDOW)):
        with caplog.at_level(logging.INFO, logger="jaxpar.models.attention_pattern"):
            out = attend(q, k, v, "cudnn", segments, pattern)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(xla_attention(q, k, v, segments, pattern)))
    assert intercepted == []
    assert sum("takes the XLA path" in r.getMessage() for r in caplog.records) == 2


def test_the_cost_model_prices_sinks_under_cudnn_as_the_xla_path():
    from jaxpar.analysis.cost.cost_model import estimate
    from tests.support import tiny

    def priced(impl, sinks):
        config = tiny.gpt_oss(attention_sinks=sinks)
        config.parallel.attention_impl = impl
        config.train.compute_dtype = "bfloat16"
        est = estimate(config, "h100-80g", num_devices=1)
        return est.memory.peak, est.time.compute

    assert priced("cudnn", True) == priced("xla", True)  # the sinks run where the XLA path runs
    cudnn, xla = priced("cudnn", False), priced("xla", False)
    assert cudnn[0] < xla[0] and cudnn[1] < xla[1]  # without them cuDNN's kernel: no scores, half the keys


@pytest.mark.gpu
def test_cudnn_sliding_window_matches_xla_on_gpu():
    # CPU is the suite's default backend: the arrays are put on the GPU, so both paths run there.
    gpu = jax.devices("gpu")[0]
    q, k, v, segments = (jax.device_put(t, gpu) for t in inputs(jnp.bfloat16))
    windows = jax.device_put(jnp.asarray([WINDOW, 0], jnp.int32), gpu)
    cotangent = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((2, *q.shape)), jnp.bfloat16), gpu)
    got, got_grads = jax.jit(lambda *a: over_layers("cudnn", windows, *a))(q, k, v, segments, cotangent)
    want, want_grads = jax.jit(lambda *a: over_layers("xla", windows, *a))(q, k, v, segments, cotangent)
    assert "cudnn" in jax.jit(lambda *a: over_layers("cudnn", windows, *a)).lower(q, k, v, segments, cotangent).compile().as_text()
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=5e-2, rtol=5e-2)
