"""Config checks of the `train` and `checkpoint` sections: ranges and choices, one line per problem
naming the key. (Divisibilities with the mesh live with the parallelism that needs them.)"""

from __future__ import annotations

import os

from jaxpar.dtypes import DTYPES
from jaxpar.ranges import at_least, one_of, positive, within

NONFINITE_POLICIES = ("stop", "skip")
# train.seed feeds jax.random.key and grain's shuffle (both take 32-bit seeds).
MAX_SEED = 2**31 - 1


def train_ranges(train) -> list[str]:
    """Sizes, rates and fractions: when these are fine, the divisibility checks can run."""
    errors = []
    for key in ("steps", "global_batch_size", "seq_len", "grad_accum", "log_every", "loss_scale_period", "skip_window"):
        errors += at_least(f"train.{key}", train[key], 1)
    errors += at_least("train.warmup_steps", train.warmup_steps, 0)
    errors += at_least("train.max_skipped_steps", train.max_skipped_steps, 0)
    errors += within("train.seed", train.seed, 0, MAX_SEED)
    for key in ("learning_rate", "max_grad_norm", "adam_eps", "loss_scale_init"):
        errors += positive(f"train.{key}", train[key])
    errors += within("train.final_learning_rate_fraction", train.final_learning_rate_fraction, 0.0, 1.0)
    errors += at_least("train.weight_decay", train.weight_decay, 0.0)
    for key in ("adam_b1", "adam_b2"):
        errors += within(f"train.{key}", train[key], 0.0, 1.0, high_open=True)
    if train.max_skipped_fraction <= 0 or train.max_skipped_fraction > 1:
        errors.append(f"train.max_skipped_fraction={train.max_skipped_fraction!r} must be in (0, 1]")
    return errors


def train_choices(train) -> list[str]:
    errors = []
    for key in ("compute_dtype", "param_dtype"):
        errors += one_of(f"train.{key}", train[key], DTYPES)
    errors += one_of("train.on_nonfinite", train.on_nonfinite, NONFINITE_POLICIES)
    if train.init_from_hf and not os.path.isdir(train.init_from_hf):
        errors.append(f"train.init_from_hf={train.init_from_hf!r} is not a directory; point it at a transformers checkpoint")
    return errors


def checkpoint_checks(checkpoint) -> list[str]:
    return at_least("checkpoint.every_steps", checkpoint.every_steps, 0) + at_least("checkpoint.keep", checkpoint.keep, 0)
