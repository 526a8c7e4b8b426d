"""How the next token is chosen from the logits: greedy, or temperature / top-k / top-p sampling.

`SamplingParams` is the record (static under jit: one compiled step per setting); `problems`
names each bad value in one line; `choose` runs inside the jitted prefill and decode step.
Order as in transformers' `generate`: temperature, then top-k, then top-p (nucleus), then one
categorical draw from the key of (seed, step) — reproducible for a seed, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Logit given to filtered tokens (finite: a row can never become all-NaN).
_REMOVED = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax; top_k / top_p ignored)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def problems(params: SamplingParams, vocab_size: int, prefix: str = "--") -> list[str]:
    """One line per bad value, naming the flag (`prefix` + name)."""
    errors = []
    if not params.temperature >= 0.0:  # also NaN
        errors.append(f"{prefix}temperature={params.temperature} must be >= 0 (0: greedy)")
    if not 0 <= params.top_k <= vocab_size:
        errors.append(f"{prefix}top_k={params.top_k} must be between 0 (off) and the vocab size {vocab_size}")
    if not 0.0 < params.top_p <= 1.0:
        errors.append(f"{prefix}top_p={params.top_p} must be in (0, 1] (1: off)")
    return errors


def filtered_logits(logits, params: SamplingParams):
    """fp32 logits [B, V] after temperature, top-k and top-p; removed tokens get a huge negative
    logit. Ties at the top-k / top-p threshold are all kept (the allowed set is a value cut)."""
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k:
        kth = jax.lax.top_k(logits, params.top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth, logits, _REMOVED)
    if params.top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
        # Keep the smallest prefix whose mass reaches top_p: a token stays while the mass before
        # it is below top_p (the most likely token always stays).
        kept = before < params.top_p
        threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, _REMOVED)
    return logits


def step_key(seed, step):
    return jax.random.fold_in(jax.random.key(seed), step)


def choose(logits, params: SamplingParams, seed, step):
    """int32 token ids [B] from fp32 logits [B, V] (the real vocab only)."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(step_key(seed, step), filtered_logits(logits, params), axis=-1).astype(jnp.int32)
