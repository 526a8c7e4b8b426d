"""Log-likelihoods and greedy continuations of token sequences, batched into a few fixed shapes.

`Scorer` runs the model's full forward (`jaxpar.models.apply`, the sampler's model config and
layout: dropless MoE, tensor / expert / data axes) on right-padded rows and returns, per request,
the summed log-probability of its continuation tokens and whether each of them was the argmax:
what lm-eval's `loglikelihood` asks. Right padding needs no mask: attention is causal, so a row's
real tokens never see the padding after them. Generation is the KV-cache sampler's
(`jaxpar.sampling.Sampler.generate`).

Shapes: requests are sorted by length (longest first, as lm-eval's own backends do) and cut into
batches of `rows` rows (a multiple of the mesh's batch axes); a batch's length is the power of two
>= its longest row (at least 16, at most `max_length`), and a short last batch repeats its first row.
So a task compiles once per length bucket, never per request.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import models
from jaxpar.sampling.engine import bucket
from jaxpar.sampling.filters import SamplingParams


def window(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """(inputs, targets) of one request, cut from the left to `max_length` inputs as lm-eval's
    transformers backend cuts them: the last max_length + 1 tokens of context + continuation."""
    whole = (list(context) + list(continuation))[-(max_length + 1):]
    return whole[:-1], whole[1:]


class Scorer:
    """Continuation log-likelihoods for one model on the sampler's mesh."""

    def __init__(self, sampler, max_length: int, rows: int = 16):
        self.sampler, self.max_length = sampler, int(max_length)
        divisor = sampler.batch_divisor
        self.rows = max(1, -(-int(rows) // divisor)) * divisor
        replicated = None if sampler.mesh is None else NamedSharding(sampler.mesh, P())
        self._score = jax.jit(self._score_fn, out_shardings=(replicated, replicated))
        self.shapes: set[tuple[int, int]] = set()  # (rows, length) of every batch run: the compiled shapes

    def _score_fn(self, params, tokens, targets):
        logits, _ = models.apply(self.sampler.cfg, params, tokens, self.sampler.opts)
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # padded vocab columns hold finfo.min
        picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(logits, axis=-1) == targets

    def loglikelihoods(self, params, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether every continuation token was the argmax)
        per (context ids, continuation ids), in request order; `params` placed by the sampler."""
        windows = [window(context, continuation, self.max_length) for context, continuation in requests]
        order = sorted(range(len(requests)), key=lambda i: -len(windows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.rows):
            chosen = order[start : start + self.rows]
            length = min(bucket(len(windows[chosen[0]][0])), max(self.max_length, 1))
            tokens, targets = np.zeros((2, self.rows, length), np.int32)
            for row in range(self.rows):
                inputs, wanted = windows[chosen[row] if row < len(chosen) else chosen[0]]
                tokens[row, : len(inputs)], targets[row, : len(wanted)] = inputs, wanted
            self.shapes.add((self.rows, length))
            picked, greedy = jax.device_get(self._score(params, self._place(tokens), self._place(targets)))
            for row, i in enumerate(chosen):
                n_inputs, n_scored = len(windows[i][0]), len(requests[i][1])
                span = slice(n_inputs - n_scored, n_inputs)  # the continuation's targets: the row's last ones
                results[i] = (float(np.sum(picked[row, span], dtype=np.float64)), bool(np.all(greedy[row, span])))
        return results

    def _place(self, array: np.ndarray):
        if self.sampler.mesh is None:
            return jnp.asarray(array)
        return jax.device_put(array, self.sampler.opts.rules.sharding(("batch", None)))


def generate(sampler, params, prompts: list[list[int]], max_new_tokens: int, eos_id, rows: int,
             sampling: SamplingParams = SamplingParams()) -> list[list[int]]:
    """Continuations of `prompts` by the KV-cache sampler (greedy by default), `rows` prompts per
    call (one batch shape; prompts sorted by length so each call's prompt-length bucket is tight)."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    rows = max(1, math.ceil(rows / sampler.batch_divisor)) * sampler.batch_divisor
    for start in range(0, len(order), rows):
        chosen = order[start : start + rows]
        batch = [prompts[i] for i in chosen] + [prompts[chosen[0]]] * (rows - len(chosen))  # one batch shape
        result = sampler.generate(params, batch, max_new_tokens, sampling, eos_id=eos_id)
        for i, completion in zip(chosen, result.completions):
            out[i] = completion
    return out
