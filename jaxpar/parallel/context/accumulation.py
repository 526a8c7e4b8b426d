"""Gradient accumulation under context parallelism: one gradient reduction per step, not per microbatch.

Parameters are replicated over `context`, so each microbatch's gradient is a sum over the context
ranks' partial gradients. Left to the partitioner, with the accumulator laid out like the
parameters, that sum is an all-reduce over `context` of every layer's gradient inside the layer
scan, once per microbatch (measured: Llama 3 70B data 4 x context 2 x 128 microbatches, 36 TB per
step over `context` where 0.28 TB would do). Here every (data replica, context rank) pair runs the
microbatch loop on its own rows and sequence slice inside a `jax.shard_map` manual over the batch
axes and `context` (tensor and the other axes stay with the partitioner), keeps its own partial
gradient, and the partials are summed once after the loop — the pipeline engine's way.

Collectives: attention's over `context` (the kernel runs per device, as in the pipeline engine);
one all-reduce of the gradients over the batch axes and `context` per step (ZeRO-1 included: the
step then keeps the optimizer's shard). Llama 3 70B on 8 emulated devices, data 4 x context 2,
all_gather: 37.6 TB per device per step before, 1.52 TB after (docs/sweeps/llama3_70b_8dev).
With tensor > 1 the partitioner gathers the heads over `tensor` in front of the all_gather and
all_to_all exchanges, as in the pipeline engine (a nested shard_map manual over tensor fails to
lower in jax 0.10.2); priced in `analysis.cost.comm_context`, and still far less than the old
per-microbatch sums (70B data 2 x context 2 x tensor 2: 67.7 TB -> 31.3 TB per device per step).
The loss and metrics are means over the ranks: each rank holds the mean over its own tokens,
and every rank holds as many (rows split evenly, sequence split evenly).

Chosen by the plan (`GradientStrategy.PER_RANK`: grad_accum > 1, mesh.context > 1, no ZeRO-3, no
MoE auxiliary losses). Proven equal to one device by tests/parallel/test_context.py (the `accum` cases);
one gradient reduction per step by
tests/analysis/test_compiled.py::test_context_accumulation_reduces_gradients_once_per_step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.axes import CONTEXT
from jaxpar.manual import manual_spec, vary_everywhere
from jaxpar.parallel.context.sequence import split_rows
from jaxpar.parallel.data import split_microbatches


def per_rank_grads(loss_fn, params, batch, *, accum: int, rules, plan, scale, param_names):
    """(loss, fp32 unscaled grads, metrics) over the global batch [G, S+1], accumulated over
    `accum` microbatches by every (replica, context rank) on its own tokens.

    `loss_fn(params, token_batch, rules, scale=...)` -> (loss · scale, (loss, metrics)) for one
    rank's `TokenBatch`; `param_names`: the params tree's logical axis names (the summed gradients
    are laid out like the parameters)."""
    mesh = rules.mesh
    manual = frozenset({*plan.batch_axes, CONTEXT})
    lead = tuple(a for a in mesh.axis_names if a in manual)
    ranks = math.prod(mesh.shape[a] for a in lead)
    micro = split_microbatches(batch, accum, rules)
    sequences = split_rows(micro, plan.context, rules, names=(None, "batch", "seq"))
    token_spec = manual_spec(rules, (None, "batch", "seq"), manual)

    def body(params, sequences, scale):
        inner = rules.without(*manual).on(jax.sharding.get_abstract_mesh())
        # Varying over every manual axis before the vjp: differentiating with respect to a value
        # replicated over `context` would psum its gradient over `context` right there.
        params = jax.tree.map(vary_everywhere, params)
        grad_fn = jax.value_and_grad(lambda p, seq: loss_fn(p, seq, inner, scale=scale), has_aux=True)

        def micro_step(carry, seq):
            (_, (loss, metrics)), grads = grad_fn(params, seq)
            return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), carry, (loss, metrics, grads)), None

        shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], sequences))
        zeros = jax.tree.map(
            lambda s: vary_everywhere(jnp.zeros(s.shape, jnp.float32)), (shapes[0][1][0], shapes[0][1][1], shapes[1])
        )
        totals, _ = jax.lax.scan(micro_step, zeros, sequences)
        loss, metrics, grads = jax.tree.map(lambda t: t / accum, totals)
        loss, metrics = jax.tree.map(lambda x: jax.lax.pmean(x, lead), (loss, metrics))
        return loss, metrics, jax.tree.map(lambda g: g[None], grads)

    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(), params), jax.tree.map(lambda _: token_spec, sequences), P()),
        out_specs=(P(), P(), jax.tree.map(lambda _: P(lead), params)),
        axis_names=manual,
    )
    loss, metrics, grads = run(params, sequences, jnp.asarray(scale, jnp.float32))
    # The one reduction per step: an all-reduce over the batch axes and `context` (under ZeRO-1
    # too, where the step then slices the optimizer's shard: leaving the layout to the step's
    # constraint compiles the same). Each rank's loss is the mean over its own tokens and all
    # hold as many, so the global mean's gradient is the ranks' sum divided by their count.
    grads = jax.tree.map(
        lambda g, names: rules.constrain((jnp.sum(g, axis=0) / ranks / scale).astype(jnp.float32), names),
        grads, param_names,
    )
    return loss, grads, metrics
