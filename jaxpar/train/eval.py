"""Held-out evaluation: the mean next-token loss over an eval set, on the training mesh.

The eval step is compiled once, before the run starts (`Evaluator`), on the training program's
mesh and shardings: the parameters stay where training keeps them and the eval batches are laid
out like training's. It runs forward only and reports the cross-entropy alone (no MoE auxiliary
losses), as (mean over the batch's real targets, their count), by the plan's layout:
- without pipeline parallelism, the batch in `train.grad_accum` microbatches (as training splits
  it: an eval batch needs no more activation memory than a training microbatch's forward) under
  `lax.map`, each run like the training step's forward (tensor, sequence, context, expert
  parallelism and ZeRO as planned);
- with pipeline parallelism, the pipeline engine in its loss-only mode
  (`jaxpar.parallel.pipeline.engine.pipelined_loss`): the training schedule's table with every B
  and W action idle, so only its F actions and the head run and nothing is stashed for a backward.
  The table keeps its training length (the idle steps cost one small send each); a dedicated
  forward-only table would be shorter, this one needs no second slot plan.

The eval set (`jaxpar.data.corpus.eval_batches`) is read from its start every time, in a fixed
order, packed as training packs: the same batches on every mesh and after every resume. The loss
over several batches is Σ (batch loss × batch targets) / Σ targets: the mean over every real
target of the set, whatever the batches' padding. `eval.steps` = 0 reads the whole set once.

Records (`record`): {"step", "eval_loss", "eval_perplexity", "eval_tokens"}, one per evaluation,
beside the training records in metrics.jsonl (and TensorBoard scalars of the same names).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import models
from jaxpar.data.batches import to_global
from jaxpar.data.corpus import batch_channels, eval_batches, eval_enabled
from jaxpar.parallel.context.sequence import document_batch, split_rows, target_count
from jaxpar.parallel.data import GradientStrategy, split_microbatches
from jaxpar.parallel.pipeline.engine import pipelined_loss
from jaxpar.parallel.tensor import mean_cross_entropy
from jaxpar.train.step import stage_model


def eval_loss(params, batch, *, model_config, opts):
    """(mean cross-entropy over the batch's real targets, their count) for a global batch
    [G, 2, S+1] of packed documents (or token rows [G, S+1])."""
    batch = document_batch(batch)
    count = target_count(batch)
    if opts.plan.gradient is GradientStrategy.PIPELINED:
        return pipelined_loss(params, batch, model=stage_model(model_config), opts=opts), count

    def forward(rows):
        seq = split_rows(rows, opts.plan.context, opts.rules)
        logits, _ = models.apply(model_config, params, seq.tokens, opts, seq.positions, seq.segment_ids)
        return mean_cross_entropy(logits, seq.targets, seq.weights)

    accum = opts.plan.grad_accum
    if accum == 1:
        return forward(batch), count
    return jnp.mean(jax.lax.map(forward, split_microbatches(batch, accum, opts.rules))), count


class Evaluator:
    """The compiled eval step of one training program, and the evaluations of a run."""

    def __init__(self, config, program):
        self.config, self.program = config, program
        self.every = int(config.eval.every_steps)
        train = config.train
        shape = (train.global_batch_size, batch_channels(config), train.seq_len + 1)
        replicated = NamedSharding(program.mesh, P())
        step = jax.jit(
            lambda params, batch: eval_loss(params, batch, model_config=program.model_config or config.model, opts=program.opts),
            in_shardings=(program.state_shardings.params, program.batch_sharding),
            out_shardings=(replicated, replicated),
        )
        params = jax.eval_shape(program.init).params
        self.step = step.lower(params, jax.ShapeDtypeStruct(shape, np.int32, sharding=program.batch_sharding)).compile()

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def run(self, params, step: int, stop=None) -> dict | None:
        """Evaluates `params` on the eval set; the metrics record of training step `step`. `stop()`
        is asked before each batch (a signal arrived, the same answer on every process): then the
        evaluation ends there and returns None."""
        batches, limit = eval_batches(self.config), int(self.config.eval.steps)
        total, tokens = 0.0, 0
        for i, batch in enumerate(batches):
            if limit and i >= limit:
                break
            if stop is not None and stop() is not None:
                return None
            loss, count = jax.device_get(self.step(params, to_global(batch, self.program.batch_sharding)))
            total += float(loss) * int(count)
            tokens += int(count)
        return record(step, total / max(tokens, 1), tokens)


def record(step: int, loss: float, tokens: int) -> dict:
    return {"step": int(step), "eval_loss": float(loss), "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_tokens": int(tokens)}


def evaluator(config, program) -> Evaluator | None:
    """The run's evaluator, or None when no eval set is configured."""
    return Evaluator(config, program) if eval_enabled(config) else None
