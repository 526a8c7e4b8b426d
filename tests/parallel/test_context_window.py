"""Context parallelism on sliding-window layers exchanges only what a window reaches
(`jaxpar.parallel.context.window`): every implementation against the XLA path on one device
(`xla_attention`), and the compiled program's collective-permutes per layer kind against the
window's geometry and the cost model (`jaxpar.analysis.cost.comm_context`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.cost.comm_context import context_collectives
from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.program.hlo import COLLECTIVE_PERMUTE, collectives
from jaxpar.models.attention_pattern import Pattern, xla_attention
from jaxpar.parallel.context import context_attention, load_balance_order
from jaxpar.parallel.context.sequence import segment_positions
from jaxpar.parallel.context.window import Reach
from tests.support import tiny
from tests.support.tiers import slow_except

IMPLS = ("all_gather", "ring", "all_to_all")
HEADS = (8, 2)  # query, KV heads
FP32_RTOL = 1e-5  # max |error| / max |reference|; measured ≤ 3.8e-7


def _mesh(context):
    return Mesh(np.array(jax.devices()[:context]), ("context",), axis_types=(AxisType.Auto,))


def _inputs(b, s, hq, hkv, d, seed=0):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, s, hq, d))
    k, v = jax.random.normal(kk, (b, s, hkv, d)), jax.random.normal(kv, (b, s, hkv, d))
    return q, k, v, jax.random.normal(kc, (b, s, hq, d))


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# ---------------------------------------------------------------- sliding windows: only what a window reaches

# A rank's chunk at c = 4 of 32 tokens: 8 (contiguous) or two pieces of 4 (load-balanced). Three
# "layers" in one scan with traced windows, as the model runs them: 2 (under a piece), 0 (full) and
# 11 (over a chunk); `Reach.span` 11, so the sliding ones take the windowed exchange by `lax.cond`.
WINDOWS, SPAN = (2, 0, 11), 11
WINDOW_SEGMENTS = np.array([[1] * 11 + [2] * 14 + [3] * 4 + [0] * 3, [5] * 20 + [6] * 12], np.int32)
# The window-using families' settings: gpt-oss sinks; Gemma 3 query_pre_attn_scalar (24^-1/2), no soft-cap.
FAMILIES = {"gpt_oss": dict(sinks=True, scale=None), "gemma3_text": dict(sinks=False, scale=24.0**-0.5)}


def _layers_loss(attend, q, k, v, sinks, cotangent, windows):
    """sum over the layers of sum(attention · cotangent), each layer a scan step with its window
    and its own scale of k and v (so no exchange is loop-invariant, as in a model)."""
    def layer(total, window_and_factor):
        window, factor = window_and_factor
        out = attend(q, k * factor, v * factor, sinks, window)
        return total + jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.lax.scan(layer, jnp.float32(0), (windows, 1 + jnp.arange(len(windows)) / 8))


def _window_case(family, seed=8):
    q, k, v, ct = _inputs(2, 32, *HEADS, 8, seed=seed)
    sinks = jax.random.normal(jax.random.key(seed + 1), (HEADS[0],)) if FAMILIES[family]["sinks"] else None
    return q, k, v, ct, sinks, FAMILIES[family]["scale"]


@jax.jit
def _window_reference(q, k, v, sinks, cotangent, segments, scale):
    def attend(q, k, v, sinks, window):
        return xla_attention(q, k, v, segments, Pattern(window, sinks, None, scale))

    loss = lambda *a: _layers_loss(attend, *a[:4], cotangent, jnp.asarray(WINDOWS))  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)


def _window_sharded(q, k, v, sinks, cotangent, *, impl, balanced, scale, windows=WINDOWS, c=4, segments=True, span=SPAN):
    """Context-parallel ((loss, outs), grads) in text order, and the jitted step and its arguments.
    `windows` a tuple: traced, one per scan step; an int: that window, static, in a scan of two."""
    mesh = _mesh(context=c)
    order = load_balance_order(32, c) if balanced else np.arange(32)
    inverse = np.argsort(order)
    seg = jnp.asarray(WINDOW_SEGMENTS)[:, order] if segments else None
    positions = (segment_positions(jnp.asarray(WINDOW_SEGMENTS)) if segments else jnp.broadcast_to(jnp.arange(32), (2, 32)))
    act, rows = NamedSharding(mesh, P(None, "context")), NamedSharding(mesh, P(None, "context"))
    static = isinstance(windows, int)

    def attend(q, k, v, sinks, positions, window):
        return context_attention(q, k, v, positions, mesh=mesh, impl=impl, block_q=4, block_kv=4, segment_ids=seg,
                                 window=window, sinks=sinks, scale=scale, reach=Reach(span, balanced))

    def loss(q, k, v, sinks, positions, cotangent):
        if static:  # a Python int: the exchange is chosen at trace time
            return _layers_loss(lambda *a: attend(*a[:4], positions, windows), q, k, v, sinks, cotangent, jnp.zeros(2))
        return _layers_loss(lambda *a: attend(*a[:4], positions, a[4]), q, k, v, sinks, cotangent, jnp.asarray(windows))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True),
                   in_shardings=(act, act, act, None, rows, act))
    args = [x[:, order] for x in (q, k, v)] + [sinks, positions[:, order], cotangent[:, order]]
    (total, outs), grads = step(*args)
    grads = tuple(g[:, inverse] for g in grads[:3]) + grads[3:]
    return (total, outs[:, :, inverse]), grads, step, args


# Each implementation once per layout it has, each family through ring and all_gather (a case compiles
# a sharded step: the full grid of 12 took 11 more cases for no new path).
WINDOW_GRID = [("all_gather", True, "gemma3_text"), ("all_gather", False, "gpt_oss"), ("ring", True, "gpt_oss"),
               ("ring", False, "gemma3_text"), ("all_to_all", True, "gpt_oss")]
WINDOW_FAST = (("all_gather", True, "gemma3_text"),)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl, balanced, family", slow_except(WINDOW_GRID, *WINDOW_FAST),
                         ids=[f"{i}-{'balanced' if b else 'contiguous'}-{f}" for i, b, f in WINDOW_GRID])
def test_windowed_exchange_matches_one_device(impl, balanced, family):
    """Windows under a rank's piece, full and over a chunk, traced per layer (both branches of the
    exchange's cond), with packed documents and the family's sinks or query scale: outputs and the
    gradients of q, k, v (and sinks) equal the XLA path on one device."""
    q, k, v, ct, sinks, scale = _window_case(family)
    got_loss_outs, got_grads, _, _ = _window_sharded(q, k, v, sinks, ct, impl=impl, balanced=balanced, scale=scale)
    (_, want_outs), want_grads = _window_reference(q, k, v, sinks, ct, jnp.asarray(WINDOW_SEGMENTS), scale)
    names = ("out", "dq", "dk", "dv", "dsinks")
    errors = {n: _rel_err(a, b) for n, a, b in zip(names, (got_loss_outs[1], *got_grads), (want_outs, *want_grads))
              if a is not None}
    assert all(e <= FP32_RTOL for e in errors.values()), errors


def _kv_permutes_by_kind(compiled_text, layers):
    """Collective-permutes of K, V, dK or dV blocks (f32, 4-D) per layer, by the branch of the layer's
    exchange cond they sit in: {"sliding": n, "full": n} (index 1 of lax.cond is its true branch)."""
    counts, sizes = {"sliding": 0, "full": 0}, {"sliding": 0, "full": 0}
    for x in collectives(compiled_text):
        if x.kind == COLLECTIVE_PERMUTE and x.results[0].dtype == "f32" and len(x.results[0].shape) == 4:
            kind = "sliding" if x.branch and x.branch[0][1] == 1 else "full"
            counts[kind] += x.executions / layers
            sizes[kind] += x.executions * x.result_bytes / layers
    return counts, sizes


def _priced_per_layer(impl, balanced, window):
    """What the cost model plans per layer of each kind for this test's shapes (Gemma 3's tiny
    pattern: two sliding layers, one full; rows 2, seq 32, 2 KV heads of 8, fp32, context 4)."""
    config = tiny.with_overrides(tiny.gemma3_text(dict(seq_len=32, global_batch_size=2), sliding_window=window, head_dim=8),
                                 {"context": 4}, parallel=dict(context_impl=impl, context_load_balance=balanced))
    counts, sizes = {"sliding": 0, "full": 0}, {"sliding": 0, "full": 0}
    for p in context_collectives(Layout.from_config(config, 4, target="cpu")):
        kind, layers = ("sliding", 2) if p.what.startswith("CP window") else ("full", 1)
        counts[kind] += p.count / layers
        sizes[kind] += p.count * p.size / layers
    return counts, sizes


# (impl, balanced, window): K/V permutes per sliding layer. Contiguous chunks of 8: a window of 2 or
# 8 reaches the previous rank only (1 hop), 11 the two before (2 hops); load-balanced pieces of 4: a
# window of 2 the previous rank's low piece and the next rank's high one (2 hops of half a block).
# Each hop: K and V in the forward, again in the backward, dK and dV sent back: 6 permutes. A full
# layer's ring: 2 (c - 1) + 2 (c - 1) + 2 c = 20.
PERMUTE_CASES = [("ring", False, 2, 6), ("ring", False, 11, 12), ("ring", True, 2, 12), ("all_gather", False, 8, 6)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl, balanced, window, per_layer", slow_except(PERMUTE_CASES, ("ring", False, 2, 6)),
                         ids=[f"{i}-{'balanced' if b else 'contiguous'}-w{w}" for i, b, w, _ in PERMUTE_CASES])
def test_sliding_layer_permutes_only_what_its_window_reaches(impl, balanced, window, per_layer):
    """Two layers in one scan, sliding then full (traced windows, as the model runs them), context
    4: the compiled program's K/V permutes per sliding layer are what its window reaches, a full
    layer keeps the whole ring (all_gather: its all-gathers, no permute), and the cost model
    prices both kinds as compiled (count and bytes)."""
    q, k, v, ct, sinks, scale = _window_case("gemma3_text")
    _, _, step, args = _window_sharded(q, k, v, sinks, ct, impl=impl, balanced=balanced, scale=scale,
                                       windows=(window, 0), span=window, segments=False)
    counts, sizes = _kv_permutes_by_kind(step.lower(*args).compile().as_text(), layers=2)
    assert counts == {"sliding": per_layer, "full": 20 if impl == "ring" else 0}, counts
    priced_counts, priced_sizes = _priced_per_layer(impl, balanced, window)
    assert priced_counts["sliding"] == counts["sliding"] and priced_sizes["sliding"] == sizes["sliding"]
    if impl == "ring":
        assert (priced_counts["full"], priced_sizes["full"]) == (counts["full"], sizes["full"])


def test_sliding_layer_work_has_the_closed_form():
    """S 4096 over 8 ranks, chunks of 128, window 256 (two chunks): a query chunk computes its own key
    chunk and the two before it, 3 pairs (the first chunks of the sequence fewer), so the busiest rank
    computes 3 · 128 / 4096 of its S/c x S query-key products — contiguous or load-balanced, ring or
    all_gather, with the windowed exchange or the full one; all_to_all (whole sequences, 1/c of the
    heads) 3 pairs for all but the first 2 of its 32 query chunks. The cost model prices a sliding
    layer's attention FLOPs with it (Gemma 3's pattern: two sliding layers, one full)."""
    from jaxpar.analysis.cost.context_work import attention_fraction, window_fraction
    from jaxpar.analysis.cost.cost_model import computed_keys

    for impl in ("ring", "all_gather"):
        for balanced in (False, True):
            for windowed in (False, True):
                assert window_fraction(impl, 4096, 8, 128, balanced, 256, windowed) == 3 * 128 / 4096
                # 257: the fourth chunk back's nearest key is 257 tokens away, still out of reach.
                assert window_fraction(impl, 4096, 8, 128, balanced, 257, windowed) == 3 * 128 / 4096
    assert window_fraction("all_to_all", 4096, 8, 128, True, 256, False) == (32 * 3 - 3) / 32**2
    config = tiny.with_overrides(tiny.gemma3_text(dict(seq_len=4096), sliding_window=256), {"context": 8},
                                 parallel=dict(context_impl="ring", context_block_size=128))
    full = attention_fraction("ring", 4096, 8, 128, True)
    assert computed_keys(Layout.from_config(config, 8, target="cpu")) == pytest.approx(4096 * (2 * 3 * 128 / 4096 + full) / 3)
