"""A record's hyperparameters: the keys of its own config section `train.<record name>`.

Every optimizer and learning-rate schedule record (`optimizers.py`, `schedules.py`) declares its
keys here as `Hyperparameter`s, each with its default, a one-line meaning and its `Range`. From
them `jaxpar.config` builds the sections (`train.adamw.b1`, `train.wsd.decay_fraction`, ...),
preflight checks the ranges (`problems`), a resumed run compares the optimizer's keys, the
config reference (docs/config.md) prints them, and `was` — the flat `train.` key a config saved
before the sections existed used — lets `jaxpar.config.upgrade` read such a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxpar.ranges import at_least, one_of, within


@dataclass(frozen=True)
class Range:
    """The values a key takes: `choices`, or low <= value (low < value when `low_open`) and, with
    a `high`, value <= high (< high when `high_open`)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple | None = None

    def problems(self, key: str, value) -> list[str]:
        """One line per problem, naming the key (the wording of `jaxpar.ranges`)."""
        if self.choices is not None:
            return one_of(key, value, self.choices)
        if self.high is not None:
            return within(key, value, self.low, self.high, high_open=self.high_open)
        if self.low_open:
            return [] if value > self.low else [f"{key}={value!r} must be > {self.low}"]
        return at_least(key, value, self.low)

    def __str__(self) -> str:
        if self.choices is not None:
            return " | ".join(map(str, self.choices))
        if self.high is not None:
            return f"[{self.low}, {self.high}{')' if self.high_open else ']'}"
        return f"{'>' if self.low_open else '>='} {self.low}"


FRACTION = Range(0.0, 1.0)  # [0, 1]
DECAY = Range(0.0, 1.0, high_open=True)  # [0, 1): a moment's decay, a momentum
NON_NEGATIVE = Range(0.0)
POSITIVE = Range(0, low_open=True)


@dataclass(frozen=True)
class Hyperparameter:
    """One key of a record's section: `train.<record>.<name>`."""

    name: str
    default: Any  # also fixes the key's type (preflight refuses a value of another type)
    meaning: str  # one line, for the config reference
    range: Range | None = None  # None: any value of the default's type
    was: str = ""  # the flat `train.` key of configs saved before records had sections

    def problems(self, key: str, value) -> list[str]:
        return [] if self.range is None else self.range.problems(key, value)


def defaults(keys) -> dict:
    """A section's keys with their defaults."""
    return {h.name: h.default for h in keys}


def section_problems(section: str, keys, values) -> list[str]:
    """The range problems of one `train.<section>` (a ConfigDict or mapping), each naming its full key."""
    return [line for h in keys for line in h.problems(f"train.{section}.{h.name}", values[h.name])]
