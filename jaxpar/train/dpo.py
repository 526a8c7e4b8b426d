"""Direct preference optimisation (`train.objective="dpo"`): the loss of preference pairs as TRL's
sigmoid loss, with the gradient taken by the training step's own gradient paths.

A batch of pairs (`data.format="preference"`, `jaxpar.data.formats`): each pair is two consecutive
segments of one row, chosen (segment s) then rejected (segment s + 1); the loss-mask channel holds 1
at the chosen completion's targets and 2 at the rejected one's. With π and r the sums of target
log-probabilities of a completion under the policy and the reference model,
    m = β((π_c − r_c) − (π_r − r_r)),   ℓ = −(1 − ε)·log σ(m) − ε·log σ(−m),
the loss is the mean of ℓ over the batch's pairs (`train.dpo.beta` β, `train.dpo.label_smoothing` ε).

Two passes in one step:
(a) forward only, the policy and the reference: every target's log-probability (`target_logps`;
    on a pipeline mesh the engine's forward with the head per token,
    `jaxpar.parallel.pipeline.engine.pipelined_target_logps`), the per-segment sums, the loss and
    its metrics, and c = ∂loss/∂(each completion's sum), a constant from here on;
(b) the loss depends on the policy only through those sums, so ∇loss = Σ_t c(t) ∇log p_t: the
    ordinary weighted next-token loss (`jaxpar.train.step.loss_and_grads`) with target weights
    −c(t)·N (N = the batch's target slots; `document_batch`'s weights are normalised so that
    mean(CE · weight) is the loss) has exactly DPO's gradient, on every gradient strategy (data,
    ZeRO, tensor + SP, context, expert, pipeline: any schedule), with the model's auxiliary losses
    added as always. The step reports the DPO loss of pass (a), not pass (b)'s surrogate.

The reference: with LoRA the same parameters without the adapters (`lora.base_of`, no copy);
otherwise a frozen copy of the starting parameters, `TrainState.reference` (sharded like them,
checkpointed with the state, in the memory report).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import models
from jaxpar.objective import Dpo
from jaxpar.parallel.context.sequence import real_targets, sequence_order, split_rows
from jaxpar.parallel.data import split_microbatches
from jaxpar.parallel.tensor import cross_entropy

CHOSEN, REJECTED = 1, 2  # the loss-mask channel's marks of a pair's two completions


def target_logps(params, rows, *, model_config, opts):
    """log p of every next-token target [G, S] fp32 in text order, forward only, in the plan's
    microbatches (as the eval step runs: `jaxpar.train.eval`). `rows`: a `document_batch` dict."""
    params = jax.lax.stop_gradient(params)
    order = sequence_order(opts.plan.context, rows["rows"].shape[-1] - 1)
    back = None if order is None else np.argsort(order)

    def forward(part):
        seq = split_rows(part, opts.plan.context, opts.rules)
        logits, _ = models.apply(model_config, params, seq.tokens, opts, seq.positions, seq.segment_ids)
        logp = -cross_entropy(logits, seq.targets)
        return logp if back is None else logp[..., back]

    accum = opts.plan.grad_accum
    if accum == 1:
        return forward(rows)
    out = jax.lax.map(forward, split_microbatches(rows, accum, opts.rules))
    return out.swapaxes(0, 1).reshape(-1, out.shape[-1])  # microbatch m holds rows j·accum + m


def completion_marks(batch):
    """[G, S] int32: CHOSEN / REJECTED at the targets of each completion, 0 elsewhere (padding,
    prompts, segment boundaries), from a preference batch [G, 3, S+1]."""
    return jnp.where(real_targets(batch[:, 1]), batch[:, 2, 1:], 0)


def segment_sums(values, marks, segments, mark):
    """[G, S+1] fp32: the sum of `values` [G, S] over the targets marked `mark`, by the target's
    segment id (segments [G, S+1])."""
    rows = jnp.arange(values.shape[0])[:, None]
    picked = jnp.where(marks == mark, values, jnp.float32(0))
    return jnp.zeros(segments.shape, jnp.float32).at[rows, segments[:, 1:]].add(picked)


def pair_loss(policy, reference, counts, dpo: Dpo):
    """(mean loss over the pairs, metrics). Each argument's CHOSEN / REJECTED entry is [G, S+1] by
    segment id; pair k of a row is (chosen segment k, rejected segment k + 1)."""
    (pc, pr), (rc, rr) = policy, reference
    chosen = dpo.beta * (pc[:, :-1] - rc[:, :-1])
    rejected = dpo.beta * (pr[:, 1:] - rr[:, 1:])
    real = (counts[0][:, :-1] > 0) & (counts[1][:, 1:] > 0)
    margin = chosen - rejected
    eps = dpo.label_smoothing
    losses = -(1 - eps) * jax.nn.log_sigmoid(margin) - eps * jax.nn.log_sigmoid(-margin)
    pairs = jnp.maximum(jnp.sum(real, dtype=jnp.float32), 1.0)
    mean = lambda x: jnp.sum(jnp.where(real, x, jnp.float32(0))) / pairs  # noqa: E731
    metrics = {
        "rewards_chosen": mean(chosen), "rewards_rejected": mean(rejected),
        "rewards_accuracy": mean((chosen > rejected).astype(jnp.float32)), "rewards_margin": mean(margin),
        "pairs": jnp.sum(real, dtype=jnp.int32),
    }
    return mean(losses), metrics


def dpo_pass(params, reference, batch, *, model_config, reference_config, opts, dpo: Dpo, logps=target_logps):
    """Pass (a) of the module docstring on a preference batch [G, 3, S+1]: (DPO loss, metrics, the
    surrogate batch for pass (b): `document_batch`'s dict with the weights −c(t)·N). `logps`:
    `target_logps`'s contract (the pipeline's engine on a pipeline mesh)."""
    rows, segments = batch[:, 0], batch[:, 1]
    marks = completion_marks(batch)
    plain = {"rows": rows, "segments": segments, "weights": (marks > 0).astype(jnp.float32)}
    per_target = [logps(p, plain, model_config=c, opts=opts) for p, c in ((params, model_config), (reference, reference_config))]
    sums = [tuple(segment_sums(lp, marks, segments, m) for m in (CHOSEN, REJECTED)) for lp in per_target]
    ones = jnp.ones(marks.shape, jnp.float32)
    counts = tuple(segment_sums(ones, marks, segments, m) for m in (CHOSEN, REJECTED))
    (loss, metrics), slopes = jax.value_and_grad(
        lambda policy: pair_loss(policy, sums[1], counts, dpo), has_aux=True
    )(sums[0])
    target_segments = segments[:, 1:]
    slope = sum(jnp.where(marks == m, jnp.take_along_axis(c, target_segments, axis=1), jnp.float32(0))
                for m, c in zip((CHOSEN, REJECTED), slopes))
    weights = jax.lax.stop_gradient(-slope * jnp.float32(marks.size))
    return loss, metrics, {"rows": rows, "segments": segments, "weights": weights}


__all__ = ["CHOSEN", "REJECTED", "dpo_pass", "pair_loss"]
