"""Packed documents train exactly like the same documents run alone.

The reference: every document of one packed batch run alone on one device — each in its own row,
positions 0 .., plain causal attention, no segments (rows are independent and causal, so what
follows a document's end in its row changes none of its logits) — its per-token losses summed per
document, and the gradient of their sum (= the sum of the per-document gradients). The packed
batch (documents of 2 .. S+1 tokens, first fit into rows, padding where none fits, one row all
padding) must give:
- on one device, every document's summed token loss within 1e-5 of its reference, through the
  xla attention path and the CPU kernel (`jaxpar_xla`);
- through the production train step on every mesh below, step 1's loss = Σ losses / Σ targets and
  gradients = Σ per-document gradients / Σ targets, within 1e-5 relative: context parallelism's
  three kernels balanced and contiguous (documents straddle chunks and ranks), inside pipeline
  stages, with sequence and tensor parallelism, gradient accumulation (per replica and per
  (replica, context rank)), Llama and Mixtral (router loss coefficients 0 there: the auxiliary
  losses are batch-level, not a sum over documents).
Mixtral with its router losses on: the aux and z losses are token-level statistics over the real
tokens, so the same documents unpacked — each alone in its own row, at the column it has in the
packed row, padding elsewhere — give the same step-1 loss (cross-entropy + aux + z), the same
router metrics and the same gradients as the packed batch, on one device and with experts, data
and context split (tests/data/test_packed_oracle.py checks the same against transformers).
The cuDNN path is the xla path's mask handed to cuDNN: on a GPU, `test_cudnn_matches_xla_with_segments`.
On CPU, what jaxpar hands cuDNN is checked without one: `causal_attention(..., "cudnn", segments)` with
`jax.nn.dot_product_attention` intercepted (the call must ask for cuDNN) and run by XLA with the same
arguments must give every document's attention computed alone (numpy, float64) and 0 on padding; and
`parallel.attention_impl="auto"` resolves to cuDNN on a GPU for 16-bit compute only.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import models
from jaxpar.models.options import RunOptions
from jaxpar.parallel.context.sequence import real_targets, segment_positions
from jaxpar.parallel.plan import ParallelPlan
from jaxpar.parallel.tensor import cross_entropy
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.documents import documents_in, packed_batch
from tests.support.reference import max_relative_error, run
from tests.support.tiers import slow_except

ROWS, SEQ = 8, 32


def _config(family: str):
    if family == "mixtral":
        return tiny.mixtral({"global_batch_size": ROWS, "seq_len": SEQ}, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    return tiny.llama({"global_batch_size": ROWS, "seq_len": SEQ})


def batch_and_documents():
    """One packed batch [8, 2, 33] and its documents (the last row left all padding)."""
    rng = np.random.default_rng(7)
    lengths = list(rng.integers(2, SEQ + 2, 40))
    docs = [rng.integers(0, 250, n) for n in lengths]
    batch = packed_batch(docs, ROWS - 1, SEQ + 1)
    batch = np.concatenate([batch, np.zeros((1, 2, SEQ + 1), np.int32)])
    found = documents_in(batch)
    assert len(found) > ROWS and (batch[:, 1] == 0).any(), "the batch must pack several documents and pad"
    return batch, found


def reference(family: str):
    """(per-document summed losses, their total, target count, gradient of the total) on one device."""
    config = _config(family)
    _, docs = batch_and_documents()
    params = models.init_params(config.model, config.train.seed)
    rows = np.zeros((len(docs), SEQ + 1), np.int32)
    mask = np.zeros((len(docs), SEQ), np.float32)
    for i, d in enumerate(docs):
        rows[i, : len(d)], mask[i, : len(d) - 1] = d, 1.0

    def per_doc(p):
        logits, _ = models.apply(config.model, p, jnp.asarray(rows[:, :-1]))
        return jnp.sum(cross_entropy(logits, jnp.asarray(rows[:, 1:])) * mask, axis=1)

    losses = jax.jit(per_doc)(params)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(per_doc(p))))(params)
    return {"losses": np.asarray(losses), "count": float(mask.sum()), "grads": jax.device_get(grads)}


@pytest.mark.parametrize("family", slow_except(["llama", "mixtral"], "llama"))
@pytest.mark.parametrize("impl", ["xla", "jaxpar_xla"])
def test_every_document_loss_equals_it_alone(family, impl, shared_cache):
    ref = shared_cache.get(f"packed-reference:{family}", lambda: reference(family))
    config = _config(family)
    batch, docs = batch_and_documents()
    params = models.init_params(config.model, config.train.seed)
    tokens, segments = batch[:, 0, :-1], batch[:, 1, :-1]
    opts = RunOptions(plan=ParallelPlan(attention=impl))
    logits, _ = jax.jit(lambda p: models.apply(config.model, p, tokens, opts, segment_positions(segments), segments))(params)
    losses = np.asarray(cross_entropy(logits, batch[:, 0, 1:]) * real_targets(batch[:, 1]))
    packed = [losses[r][(segments[r] == s) & real_targets(batch[r, 1])].sum()
              for r in range(ROWS) for s in np.unique(segments[r][segments[r] > 0])]
    assert len(packed) == len(docs)
    np.testing.assert_allclose(packed, ref["losses"], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(logits)))


def cp(impl, balanced=True, **parallel):
    return dict(context_impl=impl, context_load_balance=balanced, **parallel)


# name: (family, train overrides, mesh, parallel)
CASES = {
    "one_device_xla": ("llama", {}, {}, {"attention_impl": "xla"}),
    "data2_tensor2_sp_accum2": ("llama", {"grad_accum": 2}, {"data": 2, "tensor": 2}, {"sequence_parallel": True}),
    "c2_ring_balanced_tensor2_sp_data2": ("llama", {}, {"context": 2, "tensor": 2, "data": 2}, cp("ring", sequence_parallel=True)),
    "c2_ring_contiguous_data2_accum2": ("llama", {"grad_accum": 2}, {"context": 2, "data": 2}, cp("ring", False)),
    "c4_all_gather_contiguous_data2": ("llama", {}, {"context": 4, "data": 2}, cp("all_gather", False)),
    "pp2_1f1b_c2_all_gather_balanced_data2": (
        "llama", {}, {"pipeline": 2, "context": 2, "data": 2},
        cp("all_gather", pipeline_schedule="1f1b", num_microbatches=4),
    ),
    "mixtral_c2_all_to_all_balanced_expert2_data2": ("mixtral", {}, {"context": 2, "expert": 2, "data": 2}, cp("all_to_all")),
    "mixtral_pp2_c2_all_to_all_contiguous": (
        "mixtral", {}, {"pipeline": 2, "context": 2}, cp("all_to_all", False, pipeline_schedule="gpipe", num_microbatches=2),
    ),
}


@pytest.mark.timeout(300)
# Fast tier: one device, and packed rows through ring context + tensor SP (the others are slow).
@pytest.mark.parametrize("name", slow_except(CASES, "one_device_xla", "c2_ring_balanced_tensor2_sp_data2"))
def test_packed_batch_gradients_equal_sum_of_documents(name, shared_cache):
    family, train, mesh, parallel = CASES[name]
    ref = shared_cache.get(f"packed-reference:{family}", lambda: reference(family))
    config = tiny.with_overrides(_config(family), mesh, parallel=parallel, train=train)
    batch, _ = batch_and_documents()
    result = run(config, [batch], num_devices=math.prod(mesh.values()) if mesh else 1)
    want_loss = ref["losses"].sum() / ref["count"]
    assert abs(result["losses"][0] - want_loss) <= 1e-5 * want_loss
    want_grads = jax.tree.map(lambda g: g / ref["count"], ref["grads"])
    err = max_relative_error(result["grads1"], want_grads)
    assert err <= 1e-5, f"packed gradients differ from the per-document sum by {err:.2e} (relative)"


def unpacked(batch):
    """Every document of a packed batch [G, 2, W] alone in its own row, at its packed column (so it
    enters the model as the same inputs: a document's last token is an input in both or in
    neither), rows of padding up to a multiple of 8."""
    rows = []
    for row in batch:
        for seg in np.unique(row[1][row[1] > 0]):
            alone = np.where(row[1] == seg, row, 0)
            rows.append(alone)
    rows += [np.zeros_like(batch[0])] * (-len(rows) % 8)
    return np.stack(rows).astype(np.int32)


# name: (mesh, parallel)
ROUTER_CASES = {
    "one_device": ({}, {}),
    "expert2_data2": ({"expert": 2, "data": 2}, {}),
    "c2_all_to_all_balanced_expert2_data2": ({"context": 2, "expert": 2, "data": 2}, cp("all_to_all")),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", slow_except(ROUTER_CASES, "expert2_data2"))
def test_packed_router_losses_equal_the_documents_unpacked(name):
    mesh, parallel = ROUTER_CASES[name]
    packed, _ = batch_and_documents()
    alone = unpacked(packed)
    assert len(alone) >= 2 * len(packed) and (packed[:, 1] == 0).sum() < (alone[:, 1] == 0).sum() / 2
    results = []
    for batch in (packed, alone):
        config = tiny.with_overrides(tiny.mixtral({"global_batch_size": len(batch), "seq_len": SEQ}), mesh, parallel=parallel)
        assert config.model.router_aux_loss_coef > 0 and config.model.router_z_loss_coef > 0
        program = build(config, jax.devices()[: math.prod(mesh.values()) if mesh else 1])
        params = models.init_params(config.model, config.train.seed)
        _, metrics, grads = program.step_with_grads(program.init_from_params(params), jax.device_put(batch, program.batch_sharding))
        results.append((jax.device_get(metrics), jax.device_get(grads)))
    (m_packed, g_packed), (m_alone, g_alone) = results
    for key in ("loss", "aux_loss", "z_loss"):
        assert abs(float(m_packed[key]) - float(m_alone[key])) <= 1e-5 * abs(float(m_alone[key])), (key, m_packed[key], m_alone[key])
    np.testing.assert_allclose(m_packed["expert_fraction"], m_alone["expert_fraction"], rtol=0, atol=1e-6)
    err = max_relative_error(g_packed, g_alone)
    assert err <= 1e-5, f"packed gradients differ from the documents unpacked by {err:.2e} (relative)"


def attention_alone(q, k, v, segments):
    """Causal attention of each document by itself (numpy, float64), grouped-query heads, 0 on padding."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    group, out = q.shape[2] // k.shape[2], np.zeros(q.shape)
    for r in range(q.shape[0]):
        for s in np.unique(segments[r][segments[r] > 0]):
            at = np.flatnonzero(segments[r] == s)
            keys, values = (np.repeat(t[r, at], group, axis=1) for t in (k, v))
            scores = np.einsum("thd,shd->hts", q[r, at], keys) / np.sqrt(q.shape[-1])
            scores = np.where(np.tril(np.ones((len(at), len(at)), bool)), scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[r, at] = np.einsum("hts,shd->thd", weights / weights.sum(-1, keepdims=True), values)
    return out


def test_the_cudnn_call_carries_the_segments(monkeypatch):
    from jaxpar.models.layers import causal_attention

    batch, _ = batch_and_documents()
    segments = batch[:, 1, :-1]
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((ROWS, SEQ, 8, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((ROWS, SEQ, 2, 16)), jnp.float32) for _ in range(2))
    real, asked = jax.nn.dot_product_attention, []

    def on_cpu(*args, implementation=None, **kwargs):  # cuDNN's arguments, run where there is no cuDNN
        asked.append(implementation)
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_cpu)
    out = np.asarray(causal_attention(q, k, v, "cudnn", jnp.asarray(segments)))
    assert asked == ["cudnn"]
    np.testing.assert_allclose(out, attention_alone(q, k, v, segments), atol=1e-5, rtol=1e-5)


def test_auto_attention_is_cudnn_on_gpu_for_16_bit_compute():
    from jaxpar.parallel.plan import resolve_attention

    assert [resolve_attention("auto", dtype, "gpu") for dtype in ("bfloat16", "float16", "float32")] == ["cudnn", "cudnn", "xla"]
    assert resolve_attention("auto", "bfloat16", "cpu") == "jaxpar_xla" and resolve_attention("cudnn", "float32", "cpu") == "cudnn"


@pytest.mark.gpu
def test_cudnn_matches_xla_with_segments():
    # CPU is the suite's default backend: the arrays are put on the GPU, so both paths run there.
    gpu = jax.devices("gpu")[0]
    batch, _ = batch_and_documents()
    rng = np.random.default_rng(0)
    q = jax.device_put(jnp.asarray(rng.standard_normal((ROWS, SEQ, 8, 16)), jnp.bfloat16), gpu)
    k, v = (jax.device_put(jnp.asarray(rng.standard_normal((ROWS, SEQ, 2, 16)), jnp.bfloat16), gpu) for _ in range(2))
    from jaxpar.models.layers import causal_attention

    segments = jax.device_put(jnp.asarray(batch[:, 1, :-1]), gpu)
    grads = [jax.grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v, impl, segments).astype(jnp.float32) ** 2),  # noqa: B023
                      argnums=(0, 1, 2))(q, k, v) for impl in ("cudnn", "xla")]
    for a, b in zip(*grads):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=5e-2, rtol=5e-2)
