"""Data parallelism: the global batch split over `data` × `expert`, gradients reduced once per step.

What it shards: batch rows over `BATCH_AXES` — for dense layers the expert devices are more data
replicas. Parameters stay replicated (unless ZeRO, `jaxpar.parallel.zero`, splits them).

Gradient paths (`GradientStrategy`, chosen once by `gradient_strategy` and named in the plan):
- PLAIN: one value-and-grad over the batch (a `lax.scan` over microbatches when
  `train.grad_accum` > 1); the partitioner reduces gradients over the batch axes.
- PER_REPLICA: gradient accumulation with one data-parallel reduction per step. Accumulating
  replicated gradients would make the partitioner all-reduce them in every micro-step; instead
  each data replica accumulates its own gradient — a leading `[data]` axis via vmap's
  `spmd_axis_name` — and one mean over that axis reduces them after the loop.
- PER_RANK: the same with context parallelism, where each microbatch's gradient is also a sum over
  `context` ranks: every (replica, context rank) accumulates its own partial gradient inside a
  shard_map manual over the batch axes and `context` (`jaxpar.parallel.context.accumulation`).
- PIPELINED: the pipeline engine (`jaxpar.parallel.pipeline.engine`) accumulates inside.

Collectives: one all-reduce of the gradients per step (a reduce-scatter with ZeRO >= 1). ZeRO-3
and MoE models reduce per microbatch instead: FSDP keeps gradients sharded, and MoE
load-balancing statistics are whole-microbatch sums, which per-replica accumulation would make
depend on `mesh.data`.

Proven equal to one device by `tests/parallel/test_degeneracy.py` (data8, grad_accum with tensor, ZeRO-1,
ZeRO-3, SP and expert-as-data); one reduction per step by
`tests/analysis/test_compiled.py::test_grad_accumulation_reduces_gradients_once_per_step`.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jaxpar.axes import DATA, EXPERT

BATCH_AXES = (DATA, EXPERT)


class GradientStrategy(enum.Enum):
    PLAIN = "plain"
    PER_REPLICA = "per_replica"
    PER_RANK = "per_rank"
    PIPELINED = "pipelined"


def gradient_strategy(*, pipelined: bool, grad_accum: int, data_size: int, context_size: int,
                      zero_shards_params: bool, has_aux_losses: bool) -> GradientStrategy:
    if pipelined:
        return GradientStrategy.PIPELINED
    if grad_accum == 1 or zero_shards_params or has_aux_losses:
        return GradientStrategy.PLAIN
    # With context parallelism the partitioner would sum each microbatch's gradient over
    # `context` inside the accumulation loop (measured: Llama 3 70B data 4 x context 2,
    # 36 TB per step over context where 0.28 TB would do); per-rank accumulation sums once.
    if context_size > 1:
        return GradientStrategy.PER_RANK
    return GradientStrategy.PER_REPLICA if data_size > 1 else GradientStrategy.PLAIN


def checks(config, mesh: dict) -> list[str]:
    train, errors = config.train, []
    replicas = mesh[DATA] * mesh[EXPERT]
    if train.grad_accum < 1:
        return [f"train.grad_accum={train.grad_accum} must be >= 1"]
    if train.global_batch_size % (replicas * train.grad_accum):
        errors.append(
            f"train.global_batch_size={train.global_batch_size} is not divisible by "
            f"mesh.{DATA} × mesh.{EXPERT} × train.grad_accum={replicas * train.grad_accum}; "
            "change train.global_batch_size or train.grad_accum"
        )
    return errors


def split_microbatches(batch, accum: int, rules):
    """[G, ...] → [accum, G/accum, ...] with microbatch m = rows j·accum + m, so every data-parallel
    shard keeps its own rows: no data moves between devices. `batch`: an array or a tree of them
    (a `document_batch`)."""

    def split(x):
        micro = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        return micro if rules is None else rules.constrain(micro, (None, "batch") + (None,) * (x.ndim - 1))

    return jax.tree.map(split, batch)


def _rows(batch) -> int:
    return jax.tree.leaves(batch)[0].shape[0]


def accumulated_grads(loss_fn, params, batch, *, accum: int, rules, scale):
    """(loss, fp32 unscaled grads, metrics) of `loss_fn(params, rows, rules) -> (loss · scale,
    (loss, metrics))` over the batch, summed over `accum` microbatches by a `lax.scan`."""
    grad_fn = jax.value_and_grad(lambda p, rows: loss_fn(p, rows, rules), has_aux=True)
    if accum == 1:
        (_, (loss, metrics)), grads = grad_fn(params, batch)
    else:
        def micro_step(carry, rows):
            (_, (loss, metrics)), grads = grad_fn(params, rows)
            return jax.tree.map(jnp.add, carry, (loss, metrics, grads)), None

        shapes = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[: _rows(batch) // accum], batch)))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (shapes[0][1][0], shapes[0][1][1], shapes[1]))
        totals, _ = jax.lax.scan(micro_step, zeros, split_microbatches(batch, accum, rules))
        loss, metrics, grads = jax.tree.map(lambda t: t / accum, totals)
    grads = jax.tree.map(lambda g: (g / scale).astype(jnp.float32), grads)
    return loss, grads, metrics


def per_replica_grads(loss_fn, params, batch, *, accum: int, rules, scale):
    """`accumulated_grads` run by each data replica on its own rows, then one mean over replicas."""
    replicas = rules.mesh.shape[DATA]
    inner = rules.without(DATA)
    # Replica d holds rows [d·G/R, (d+1)·G/R): exactly the rows the data-major batch sharding gives it.
    split = jax.tree.map(lambda x: x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:]), batch)
    per_replica = jax.vmap(
        lambda p, b: accumulated_grads(loss_fn, p, b, accum=accum, rules=inner, scale=scale),
        in_axes=(None, 0),
        spmd_axis_name=DATA,
    )(params, split)
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), per_replica)
