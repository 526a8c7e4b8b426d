"""Megatron tensor parallelism over `tensor`, with sequence parallelism and a vocab-parallel loss.

What it shards (through the rules table, `jaxpar.sharding`, which reads `TensorPlan`): q/k/v and
gate/up are column-parallel (heads / `mlp` dim split), o and down row-parallel; the embedding and
LM head are vocab-parallel, and the loss is computed on vocab-sharded logits (`cross_entropy`), so
the full `[B, S, V]` logits are never gathered. With `sequence_parallel` the residual stream
between blocks is split along the sequence as well.

KV heads: when `num_key_value_heads` is a multiple of `tensor` they are split like the query
heads. When it is smaller, each tensor rank needs the one KV head its query heads use, so the
k/v activations are repeated `kv_repeat = tensor / num_key_value_heads` times before they are
split (Megatron replicates KV heads the same way); the k/v weights stay replicated.

Collectives per layer (forward): without SP, one all-reduce of `[B, S, D]` after attention and
one after the MLP; with SP, an all-gather of the sequence before each and a reduce-scatter after
(the same bytes, less activation memory). The loss all-reduces `[B, S]` scalars over `tensor`.
The backward mirrors these.

Proven equal to one device by `tests/parallel/test_degeneracy.py` (tensor2/4/8, SP, tied embeddings, one
KV head under tensor 4); "logits never gathered" by `tests/analysis/test_compiled.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.axes import TENSOR
from jaxpar.model_facts import padded_vocab_size
from jaxpar.sharding import constrain


@dataclass(frozen=True)
class TensorPlan:
    size: int = 1
    sequence_parallel: bool = False
    kv_heads_sharded: bool = True  # k/v weights split over `tensor` (else replicated)
    kv_repeat: int = 1  # copies of each KV head in the k/v activations
    # Sequence parallelism's gathers and scatters around the dense projections as exchanges of
    # permutes, each beside a partial matmul (`jaxpar.parallel.collective_matmul`, "permutes").
    collective_matmul: bool = False


def tensor_plan(config, mesh: dict) -> TensorPlan:
    size, kv = mesh[TENSOR], config.model.num_key_value_heads
    sharded = kv % size == 0
    return TensorPlan(
        size=size,
        sequence_parallel=bool(config.parallel.sequence_parallel),
        kv_heads_sharded=sharded,
        kv_repeat=1 if sharded else size // kv,
        collective_matmul=config.parallel.collective_matmul == "permutes" and size > 1,
    )


def _divides(errors, what: str, n: int, by: int, by_what: str):
    if by > 0 and n % by:
        errors.append(f"{what}={n} is not divisible by {by_what}={by}; change {what} or {by_what}")


def checks(config, mesh: dict) -> list[str]:
    """Divisibilities tensor parallelism needs, one line each naming the key to change."""
    model, t, errors = config.model, mesh[TENSOR], []
    axis = f"mesh.{TENSOR}"
    _divides(errors, "model.num_attention_heads", model.num_attention_heads, t, axis)
    if model.num_key_value_heads % t:  # replicated KV heads: each must serve whole tensor ranks
        _divides(errors, axis, t, model.num_key_value_heads, "model.num_key_value_heads")
    _divides(errors, "model.intermediate_size", model.intermediate_size, t, axis)
    padded = padded_vocab_size(model.vocab_size)
    _divides(errors, f"padded vocab (model.vocab_size={model.vocab_size} → {padded})", padded, t, axis)
    if config.parallel.sequence_parallel:
        _divides(errors, "train.seq_len", config.train.seq_len, t, f"{axis} (sequence_parallel)")
    return errors


def repeat_kv(k, v, plan: TensorPlan, rules):
    """[B, S, Hkv, D] k/v with each head repeated `kv_repeat` times (adjacent copies, so query head
    h still reads KV head h // (H / Hkv)); identity when KV heads are split over `tensor`."""
    if plan.kv_repeat == 1:
        return k, v
    # Whole heads and whole sequence first: with sequence parallelism k/v come out of the
    # projection split along the sequence, and going from there straight to split heads makes the
    # partitioner replicate and re-split ("involuntary full rematerialization"); an explicit
    # all-gather of the sequence is the move it needs.
    whole = ("batch", "seq", None, "head_dim")
    k, v = constrain(rules, k, whole), constrain(rules, v, whole)
    return jnp.repeat(k, plan.kv_repeat, axis=2), jnp.repeat(v, plan.kv_repeat, axis=2)


@jax.custom_vjp
def cross_entropy(logits, targets):
    """Per-token loss [B, S] from fp32 logits [B, S, V] (padded columns already masked).

    The log-normalizer and the label pick are both reductions over the vocab axis, so with logits
    sharded over `tensor` the partitioner all-reduces [B, S] scalars instead of gathering logits.
    The label pick is a masked sum rather than `take_along_axis`: a gather on the sharded vocab
    axis would make the partitioner collect the whole vocab on every device. The backward is
    written out (softmax − one-hot, one elementwise pass over the logits) rather than left to
    autodiff of logsumexp and the masked sum.
    """
    return _cross_entropy_fwd(logits, targets)[0]


def _label_mask(logits, targets):
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return column == targets[..., None]


def _cross_entropy_fwd(logits, targets):
    peak = jnp.max(logits, axis=-1, keepdims=True)
    log_normalizer = jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1)) + peak[..., 0]
    label_logit = jnp.sum(jnp.where(_label_mask(logits, targets), logits, 0.0), axis=-1)
    return log_normalizer - label_logit, (logits, log_normalizer, targets)


def _cross_entropy_bwd(residuals, d_loss):
    logits, log_normalizer, targets = residuals
    probs = jnp.exp(logits - log_normalizer[..., None])
    d_logits = (probs - _label_mask(logits, targets).astype(logits.dtype)) * d_loss[..., None]
    return d_logits, None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def mean_cross_entropy(logits, targets, weights=None):
    """Mean per-token loss; with `weights` [B, S] (packed documents: 0 for padding and document
    boundaries, `jaxpar.parallel.context.sequence.document_batch`) the mean of loss · weight."""
    losses = cross_entropy(logits, targets)
    return jnp.mean(losses if weights is None else losses * weights)
