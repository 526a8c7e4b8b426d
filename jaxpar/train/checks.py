"""Config checks of the `train` and `checkpoint` sections: ranges and choices, one line per problem
naming the key. (Divisibilities with the mesh live with the parallelism that needs them.)"""

from __future__ import annotations

import os

from jaxpar import fp8
from jaxpar.dtypes import DTYPES
from jaxpar.optim import OPTIMIZER_NAMES, PARAM_NAMES, SCHEDULE_NAMES, excluded_from_decay, hyperparameter_problems, optimizer
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
    for key in ("learning_rate", "max_grad_norm", "loss_scale_init"):
        errors += positive(f"train.{key}", train[key])
    errors += within("train.final_learning_rate_fraction", train.final_learning_rate_fraction, 0.0, 1.0)
    errors += at_least("train.weight_decay", train.weight_decay, 0.0)
    errors += hyperparameter_problems(train)  # every optimizer's and schedule's section, by its record
    if train.max_skipped_fraction <= 0 or train.max_skipped_fraction > 1:
        errors.append(f"train.max_skipped_fraction={train.max_skipped_fraction!r} must be in (0, 1]")
    return errors


def train_choices(train) -> list[str]:
    errors = []
    for key in ("compute_dtype", "param_dtype"):
        errors += one_of(f"train.{key}", train[key], DTYPES)
    errors += one_of("train.on_nonfinite", train.on_nonfinite, NONFINITE_POLICIES)
    errors += one_of("train.lr_schedule", train.lr_schedule, SCHEDULE_NAMES)
    errors += fp8.checks(train)
    unknown = [n for n in excluded_from_decay(train) if n not in PARAM_NAMES]
    if unknown:
        errors.append(f"train.weight_decay_exclude={train.weight_decay_exclude!r} names {unknown}, "
                      f"not parameter logical names {PARAM_NAMES}")
    if train.init_from_hf and not os.path.isdir(train.init_from_hf):
        errors.append(f"train.init_from_hf={train.init_from_hf!r} is not a directory; point it at a transformers checkpoint")
    return errors


def optimizer_checks(train, model) -> list[str]:
    """`train.optimizer` and its record's checks beyond its keys' ranges (`train_ranges` runs those)."""
    if train.optimizer not in OPTIMIZER_NAMES:
        return [f"train.optimizer={train.optimizer!r} is not one of {OPTIMIZER_NAMES}"]
    return optimizer(train.optimizer).checks(train, model)


def checkpoint_checks(checkpoint) -> list[str]:
    return at_least("checkpoint.every_steps", checkpoint.every_steps, 0) + at_least("checkpoint.keep", checkpoint.keep, 0)
