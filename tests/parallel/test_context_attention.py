"""Context-parallel causal attention kernels (jaxpar.parallel.context) against one-device attention.

Reference: `jax.nn.dot_product_attention(q, k, v, is_causal=True)` on one device, unpermuted
sequence; outputs and the gradients of sum(out · cotangent) for a random cotangent. The ring's
traffic and memory are checked on the whole train step in tests/parallel/test_context.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.context import (
    all_gather_attention_local,
    all_to_all_attention_local,
    context_attention,
    flash_attention_local,
    load_balance_inverse,
    load_balance_order,
    ring_attention_local,
)
from tests.support.hlo import collectives
from tests.support.tiers import slow_except

IMPLS = ("all_gather", "ring", "all_to_all")
FP32_RTOL = 1e-5  # max |error| / max |reference|; measured ≤ 6.2e-7 in every fp32 case


def _mesh(**axes):
    devices = np.array(jax.devices()[: int(np.prod(list(axes.values())))]).reshape(tuple(axes.values()))
    return Mesh(devices, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def _inputs(b, s, hq, hkv, d, dtype=jnp.float32, seed=0):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, s, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32).astype(dtype)
    cotangent = jax.random.normal(kc, (b, s, hq, d), jnp.float32)
    return q, k, v, cotangent


@jax.jit
def _reference(q, k, v, cotangent):
    """One device, fp32: (out, (dq, dk, dv))."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def _sharded(q, k, v, cotangent, *, mesh, impl, balanced, batch_axes=(), heads=None, block=4, **kwargs):
    """Context-parallel (out, (dq, dk, dv)) in the original sequence order, and the compiled program.
    The sequence is permuted outside the jitted step, as the integrator does once for the data."""
    c = mesh.shape["context"]
    s = q.shape[1]
    order = load_balance_order(s, c) if balanced else np.arange(s)
    inverse = load_balance_inverse(s, c) if balanced else np.arange(s)
    positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), q.shape[:2])
    batch = tuple(batch_axes) or None
    act = NamedSharding(mesh, P(batch, "context", heads, None))
    pos = NamedSharding(mesh, P(batch, "context"))

    def loss(q, k, v, positions, cotangent):
        out = context_attention(
            q, k, v, positions, mesh=mesh, impl=impl, batch_axes=batch_axes, block_q=block, block_kv=block, **kwargs
        )
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    step = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), in_shardings=(act, act, act, pos, act)
    )
    args = [x[:, order] for x in (q, k, v)] + [positions, cotangent[:, order]]
    (_, out), grads = step(*args)
    compiled = step.lower(*args).compile()
    return out[:, inverse], tuple(g[:, inverse] for g in grads), compiled, out


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _assert_close(got, want, rtol):
    (out, grads), (ref_out, ref_grads) = got, want
    pairs = zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads))
    errors = {name: _rel_err(a, b) for name, a, b in pairs}
    assert all(e <= rtol for e in errors.values()), errors
    return errors


# ---------------------------------------------------------------- load balancing


def test_load_balance_order_gives_rank_r_chunks_r_and_mirror():
    for s, c in ((16, 2), (32, 4), (48, 8)):
        order = load_balance_order(s, c)
        chunk = s // (2 * c)
        pieces = np.arange(s).reshape(2 * c, chunk)
        for r, shard in enumerate(order.reshape(c, 2 * chunk)):
            np.testing.assert_array_equal(shard, np.concatenate([pieces[r], pieces[2 * c - 1 - r]]))
        np.testing.assert_array_equal(order[load_balance_inverse(s, c)], np.arange(s))
    with pytest.raises(ValueError, match="train.seq_len"):
        load_balance_order(12, 4)


# ---------------------------------------------------------------- equality with one device


# GQA 8:2 everywhere: all_to_all repeats the 2 KV heads for c = 4 and 8.
HEADS = (8, 2)


# Every implementation at every c, balanced and contiguous alternating (not the full cross
# product: the production-step cases in tests/parallel/test_context.py cover the other orders).
GRID = [(c, impl, (i + j) % 2 == 0) for i, impl in enumerate(IMPLS) for j, c in enumerate((2, 4, 8))]


@pytest.mark.timeout(300)
# Fast tier: every implementation at c = 2.
@pytest.mark.parametrize("c, impl, balanced", slow_except(GRID, *[case for case in GRID if case[0] == 2]),
                         ids=[f"{i}-c{c}-{'balanced' if b else 'contiguous'}" for c, i, b in GRID])
def test_matches_one_device(c, impl, balanced):
    hq, hkv = HEADS
    q, k, v, ct = _inputs(2, 32, hq, hkv, 8)
    out, grads, _, _ = _sharded(q, k, v, ct, mesh=_mesh(context=c), impl=impl, balanced=balanced)
    _assert_close((out, grads), _reference(q, k, v, ct), FP32_RTOL)


@pytest.mark.timeout(300)
def test_local_flash_attention_matches_one_device():
    """c = 1: the chunked kernel alone (4 × 4 chunks of 8), GQA 8:2, one device."""
    q, k, v, ct = _inputs(2, 32, 8, 2, 8, seed=6)
    positions = jnp.arange(32, dtype=jnp.int32)

    def loss(q, k, v):
        out = flash_attention_local(q, k, v, positions, positions, block_q=8, block_kv=8)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _assert_close((out, grads), _reference(q, k, v, ct), FP32_RTOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "local",
    slow_except((all_gather_attention_local, ring_attention_local, all_to_all_attention_local), ring_attention_local),
    ids=IMPLS,
)
def test_local_functions_inside_callers_shard_map(local):
    """The per-device functions inside a caller's own shard_map (manual over context, check_vma
    on, as a pipeline stage would call them), balanced order, shared [S/c] positions."""
    c = 4
    q, k, v, ct = _inputs(2, 32, 8, 4, 8, seed=7)
    mesh = _mesh(context=c)
    order, inverse = load_balance_order(32, c), load_balance_inverse(32, c)
    seq = P(None, "context")

    def per_device(q, k, v, positions):
        return local(q, k, v, positions, positions, axis_name="context", block_q=4, block_kv=4)

    attend = jax.shard_map(per_device, mesh=mesh, in_specs=(seq, seq, seq, P("context")), out_specs=seq)

    def loss(q, k, v, ct):
        out = attend(q, k, v, jnp.asarray(order, jnp.int32))
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        *(x[:, order] for x in (q, k, v, ct))
    )
    got = (out[:, inverse], tuple(g[:, inverse] for g in grads))
    _assert_close(got, _reference(q, k, v, ct), FP32_RTOL)


def test_all_to_all_rejects_indivisible_heads():
    q, k, v, _ = _inputs(1, 16, 12, 3, 8)  # 3 KV heads: neither divisible by 4 nor a divisor of it
    with pytest.raises(ValueError, match="mesh.context=4"):
        context_attention(q, k, v, jnp.arange(16), mesh=_mesh(context=4), impl="all_to_all")
    q, k, v, _ = _inputs(1, 16, 6, 2, 8)  # 6 query heads over 4 ranks
    with pytest.raises(ValueError, match="mesh.context=4"):
        context_attention(q, k, v, jnp.arange(16), mesh=_mesh(context=4), impl="all_to_all")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", slow_except(IMPLS, "ring"))
def test_tensor_and_context(impl):
    """Heads sharded over tensor=2, sequence over context=4: same numbers, output laid out like q."""
    hq, hkv = (8, 8) if impl == "all_to_all" else (8, 4)
    q, k, v, ct = _inputs(2, 32, hq, hkv, 8, seed=1)
    mesh = _mesh(context=4, tensor=2)
    out, grads, _, out_permuted = _sharded(q, k, v, ct, mesh=mesh, impl=impl, balanced=True, heads="tensor")
    _assert_close((out, grads), _reference(q, k, v, ct), FP32_RTOL)
    assert out_permuted.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "context", "tensor", None)), 4)


def _batch_dims_of_collectives(compiled):
    """Leading (batch) dimension of every K/V-sized collective's result; the skip predicates'
    scalars have no batch dimension."""
    return {shape[0] for col in collectives(compiled.as_text()) for shape in col.shapes if len(shape) >= 2}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", slow_except(IMPLS, "ring"))
def test_data_and_context_keep_batch_sharded(impl):
    """data=2 × context=4 with the batch manual over data: same numbers, and every collective moves
    this data replica's 2 rows, never the global 4."""
    hq, hkv = HEADS
    q, k, v, ct = _inputs(4, 32, hq, hkv, 8, seed=2)
    mesh = _mesh(data=2, context=4)
    out, grads, compiled, _ = _sharded(q, k, v, ct, mesh=mesh, impl=impl, balanced=True, batch_axes=("data",))
    _assert_close((out, grads), _reference(q, k, v, ct), FP32_RTOL)
    assert _batch_dims_of_collectives(compiled) == {2}


@pytest.mark.timeout(300)
def test_batch_left_to_partitioner_is_gathered():
    """Positive control for the check above (and the reason `batch_axes` exists): with the batch
    left Auto, Shardy (jax 0.10.2) all-gathers all 4 rows in front of the all-gather over context."""
    q, k, v, ct = _inputs(4, 32, 8, 2, 8, seed=2)
    mesh = _mesh(data=2, context=4)
    batch = NamedSharding(mesh, P("data", "context", None, None))
    q, k, v = (jax.device_put(x, batch) for x in (q, k, v))
    positions = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (4, 32))
    compiled = (
        jax.jit(lambda q, k, v, p: context_attention(q, k, v, p, mesh=mesh, impl="all_gather"))
        .lower(q, k, v, positions)
        .compile()
    )
    assert 4 in _batch_dims_of_collectives(compiled)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", slow_except(IMPLS, "ring"))
def test_under_vmap_over_data(impl):
    """The train step's per-replica accumulation: vmap(spmd_axis_name="data") around the call,
    `data` passed as vmapped_axes, shared [S] positions. Same numbers; per-replica collectives."""
    hq, hkv = HEADS
    q, k, v, ct = _inputs(4, 32, hq, hkv, 8, seed=3)
    mesh = _mesh(data=2, context=4)
    order, inverse = load_balance_order(32, 4), load_balance_inverse(32, 4)
    split = lambda x: x.reshape(2, 2, *x.shape[1:])  # noqa: E731  [replica, rows, ...]
    attend = lambda q, k, v, p: context_attention(  # noqa: E731
        q, k, v, p, mesh=mesh, impl=impl, vmapped_axes=("data",), block_q=4, block_kv=4
    )

    def loss(q, k, v, ct):
        out = jax.vmap(attend, in_axes=(0, 0, 0, None), spmd_axis_name="data")(
            split(q), split(k), split(v), jnp.asarray(order, jnp.int32)
        )
        out = out.reshape(q.shape)
        return jnp.sum(out * ct), out

    act = NamedSharding(mesh, P("data", "context", None, None))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), in_shardings=(act,) * 4)
    args = [x[:, order] for x in (q, k, v, ct)]
    (_, out), grads = step(*args)
    got = (out[:, inverse], tuple(g[:, inverse] for g in grads))
    _assert_close(got, _reference(q, k, v, ct), FP32_RTOL)
    compiled = step.lower(*args).compile()
    assert _batch_dims_of_collectives(compiled) == {1}  # [replica-slice 1, rows 2, ...]
    # Shared positions keep the skip predicates unbatched, so the conds survive vmap (with
    # per-row positions vmap turns them into selects that run both branches: 0 conditionals).
    assert " conditional(" in compiled.as_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", slow_except(IMPLS, "ring"))
def test_bf16_inputs(impl):
    """bf16 q/k/v (fp32 statistics inside) against fp32 attention on the same bf16-rounded inputs."""
    hq, hkv = HEADS
    q, k, v, ct = _inputs(2, 32, hq, hkv, 8, dtype=jnp.bfloat16, seed=4)
    out, grads, _, _ = _sharded(q, k, v, ct, mesh=_mesh(context=4), impl=impl, balanced=True)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    _assert_close((out, grads), _reference(q, k, v, ct), 2e-2)  # measured ≤ 5.1e-3 (bf16 eps 7.8e-3)


# ---------------------------------------------------------------- masked work is skipped


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_blocks_are_skipped(impl):
    """NaN keys/values on the last rank (contiguous order) reach no earlier query only if every
    block / chunk pair that lies wholly in their future is skipped: computed and masked, NaN·0
    would poison the outputs (p·v) and dq (do·vᵀ) of every query."""
    hq, hkv = HEADS
    q, k, v, ct = _inputs(2, 32, hq, hkv, 8, seed=5)
    poisoned = lambda x: x.at[:, 24:].set(jnp.nan)  # noqa: E731  rank 3 of context=4
    out, (dq, _, _), _, _ = _sharded(q, poisoned(k), poisoned(v), ct, mesh=_mesh(context=4), impl=impl, balanced=False)
    ref_out, (ref_dq, _, _) = _reference(q, k, v, ct)
    assert np.isnan(np.asarray(out[:, 24:])).all()  # the poisoned rank's own queries do see NaN
    assert _rel_err(out[:, :24], ref_out[:, :24]) <= FP32_RTOL
    assert _rel_err(dq[:, :24], ref_dq[:, :24]) <= FP32_RTOL


# ---------------------------------------------------------------- packed documents (segment ids)

# Segment ids of two rows of 32: documents straddle every chunk of 4 and every rank's shard, one
# row ends in padding (0) and one document is a single token.
SEGMENTS = np.array([[1] * 5 + [2] * 14 + [3] + [4] * 9 + [0] * 3, [1] * 8 + [2] * 8 + [3] * 16], np.int32)


@jax.jit
def _segment_reference(q, k, v, segments, cotangent):
    """One device, fp32, written out: softmax over earlier keys of the query's own segment; a
    padding query (segment 0) outputs 0. (out, (dq, dk, dv))."""

    def loss(q, k, v):
        g = q.shape[2] // k.shape[2]
        kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(q.shape[-1])
        t = q.shape[1]
        visible = (np.tril(np.ones((t, t), bool))[None]
                   & (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0))[:, None]
        p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1) * visible
        out = jnp.einsum("bhqk,bkhd->bqhd", p, vr)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def _sharded_segments(q, k, v, segments, cotangent, *, c, impl, balanced, block=4):
    """Context-parallel (out, (dq, dk, dv)) with segment ids, in text order."""
    mesh = _mesh(context=c)
    s = q.shape[1]
    order = load_balance_order(s, c) if balanced else np.arange(s)
    inverse = load_balance_inverse(s, c) if balanced else np.arange(s)
    positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), q.shape[:2])
    act, pos = NamedSharding(mesh, P(None, "context", None, None)), NamedSharding(mesh, P(None, "context"))

    def loss(q, k, v, positions, segments, cotangent):
        out = context_attention(q, k, v, positions, mesh=mesh, impl=impl, block_q=block, block_kv=block,
                                segment_ids=segments)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), in_shardings=(act, act, act, pos, pos, act))
    (_, out), grads = step(*[x[:, order] for x in (q, k, v)], positions, jnp.asarray(segments)[:, order],
                           cotangent[:, order])
    return out[:, inverse], tuple(g[:, inverse] for g in grads)


SEGMENT_GRID = [(c, impl, balanced) for impl in IMPLS for c, balanced in ((2, True), (4, False))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("c, impl, balanced", slow_except(SEGMENT_GRID, *[case for case in SEGMENT_GRID if case[0] == 2]),
                         ids=[f"{i}-c{c}-{'balanced' if b else 'contiguous'}" for c, i, b in SEGMENT_GRID])
def test_segments_match_one_device(c, impl, balanced):
    """Packed documents through every kernel, balanced and contiguous: equal to the written-out
    block-diagonal reference, padding rows 0 with finite gradients (no NaN)."""
    q, k, v, ct = _inputs(2, 32, *HEADS, 8, seed=3)
    out, grads = _sharded_segments(q, k, v, SEGMENTS, ct, c=c, impl=impl, balanced=balanced)
    assert all(np.isfinite(np.asarray(x)).all() for x in (out, *grads))
    np.testing.assert_array_equal(np.asarray(out)[SEGMENTS == 0], 0.0)
    _assert_close((out, grads), _segment_reference(q, k, v, jnp.asarray(SEGMENTS), ct), FP32_RTOL)


@pytest.mark.timeout(300)
def test_local_flash_attention_with_segments():
    """c = 1: the chunked kernel alone with segment ids (chunks of 4 cut documents)."""
    q, k, v, ct = _inputs(2, 32, *HEADS, 8, seed=4)
    segments = jnp.asarray(SEGMENTS)

    def loss(q, k, v):
        pos = jnp.arange(32, dtype=jnp.int32)
        out = flash_attention_local(q, k, v, pos, pos, q_seg=segments, kv_seg=segments, block_q=4, block_kv=4)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _assert_close((out, grads), _segment_reference(q, k, v, segments, ct), FP32_RTOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", IMPLS)
def test_chunks_of_other_documents_are_skipped(impl):
    """Row 1's first document (positions 0..7, rank 0 of context=4, two chunks of 4) poisoned with
    NaN keys/values: the later documents' queries stay exact only if every chunk pair that shares
    no segment is skipped (computed and masked, NaN·0 would poison them). Without the segment
    test the causal skip alone would compute those pairs (positive control: they precede)."""
    q, k, v, ct = _inputs(2, 32, *HEADS, 8, seed=6)
    segments = np.stack([SEGMENTS[1], SEGMENTS[1]])
    poisoned = lambda x: x.at[:, :8].set(jnp.nan)  # noqa: E731
    out, (dq, _, _) = _sharded_segments(q, poisoned(k), poisoned(v), segments, ct, c=4, impl=impl, balanced=False)
    ref_out, (ref_dq, _, _) = _segment_reference(q, k, v, jnp.asarray(segments), ct)
    assert np.isnan(np.asarray(out[:, :8])).all()
    assert _rel_err(out[:, 8:], ref_out[:, 8:]) <= FP32_RTOL
    assert _rel_err(dq[:, 8:], ref_dq[:, 8:]) <= FP32_RTOL
