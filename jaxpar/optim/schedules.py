"""Learning-rate schedules (`train.lr_schedule`), one record each.

Every schedule starts with a linear warmup from 0 to `train.learning_rate` over
`train.warmup_steps` and ends at `learning_rate × final_learning_rate_fraction` after `train.steps`
updates. A schedule maps the number of updates already applied (0 for the first step) to the
learning rate of the next one, as optax counts.

- `cosine` (default): cosine decay from the peak over the steps after warmup (today's schedule,
  built by optax's `warmup_cosine_decay_schedule`, unchanged).
- `wsd`: warmup, stable at the peak, then a decay over the last `wsd.decay_fraction` of
  `train.steps` (it starts no earlier than the end of warmup), shaped `linear`, `cosine` or
  `1-sqrt` (`wsd.decay_shape`; 1-sqrt: lr = end + (peak − end)·(1 − √progress), Hägele et al. 2024).

A schedule's own keys live in its section `train.<name>`, declared on its record
(`Hyperparameter`, `jaxpar.optim.hyperparameters`); the keys every schedule reads
(`learning_rate`, `warmup_steps`, `final_learning_rate_fraction`, `steps`) stay in `train`.
- `linear`: linear decay from the peak after warmup.
- `constant`: the peak after warmup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
import optax

from jaxpar.optim.hyperparameters import FRACTION, Hyperparameter, Range

DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


@dataclass(frozen=True)
class Schedule:
    name: str  # `train.lr_schedule`, and its section `train.<name>` when it has keys
    build: Callable  # (config.train) -> optax schedule: updates applied -> learning rate
    hyperparameters: tuple[Hyperparameter, ...] = ()  # the keys of its section (ranges checked by preflight)


def _end(train) -> float:
    return train.learning_rate * train.final_learning_rate_fraction


def _after_warmup(train, schedule):
    """`schedule` (counted from the end of warmup) preceded by the linear warmup."""
    if train.warmup_steps == 0:
        return schedule
    warmup = optax.linear_schedule(0.0, train.learning_rate, train.warmup_steps)
    return optax.join_schedules([warmup, schedule], [train.warmup_steps])


def _cosine(train):
    end_fraction = train.final_learning_rate_fraction
    if train.warmup_steps == 0:
        return optax.cosine_decay_schedule(train.learning_rate, max(train.steps, 1), alpha=end_fraction)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.learning_rate,
        warmup_steps=train.warmup_steps,
        decay_steps=max(train.steps, train.warmup_steps + 1),
        end_value=_end(train),
    )


def _linear(train):
    return _after_warmup(train, optax.linear_schedule(train.learning_rate, _end(train), max(train.steps - train.warmup_steps, 1)))


def _constant(train):
    return _after_warmup(train, optax.constant_schedule(train.learning_rate))


def wsd_phases(train) -> tuple[int, int]:
    """(first update of the decay, its length in updates) of the `wsd` schedule."""
    decay = int(round(train.wsd.decay_fraction * train.steps))
    return max(train.steps - decay, train.warmup_steps), decay


def _decay(train, length: int):
    peak, end = train.learning_rate, _end(train)
    shape = train.wsd.decay_shape
    if shape == "linear":
        return optax.linear_schedule(peak, end, length)
    if shape == "cosine":
        return optax.cosine_decay_schedule(peak, length, alpha=train.final_learning_rate_fraction)
    return lambda count: end + (peak - end) * (1.0 - jnp.sqrt(jnp.clip(count / length, 0.0, 1.0)))


def _wsd(train):
    start, length = wsd_phases(train)
    if length == 0:
        return _constant(train)
    stable = optax.constant_schedule(train.learning_rate)
    return _after_warmup(train, optax.join_schedules([stable, _decay(train, length)], [start - train.warmup_steps]))


WSD_KEYS = (
    Hyperparameter("decay_fraction", 0.2, "the last fraction of train.steps over which the rate decays", FRACTION,
                   was="wsd_decay_fraction"),
    Hyperparameter("decay_shape", "1-sqrt", "the decay's shape", Range(choices=DECAY_SHAPES), was="wsd_decay_shape"),
)

SCHEDULES = (
    Schedule("cosine", _cosine),
    Schedule("wsd", _wsd, WSD_KEYS),
    Schedule("linear", _linear),
    Schedule("constant", _constant),
)
SCHEDULE_NAMES = tuple(s.name for s in SCHEDULES)


def schedule(name: str) -> Schedule:
    for record in SCHEDULES:
        if record.name == name:
            return record
    raise ValueError(f"train.lr_schedule={name!r} is not one of {SCHEDULE_NAMES}")


def learning_rate_schedule(train):
    return schedule(train.lr_schedule).build(train)
