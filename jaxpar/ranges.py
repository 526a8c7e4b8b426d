"""Range checks of config values, one line per problem naming the key (used by every module's
config checks). Each returns a list so checks read as `errors += at_least("train.steps", v, 1)`."""

from __future__ import annotations


def at_least(key: str, value, low) -> list[str]:
    return [] if value >= low else [f"{key}={value!r} must be >= {low}"]


def positive(key: str, value) -> list[str]:
    return [] if value > 0 else [f"{key}={value!r} must be > 0"]


def within(key: str, value, low, high, *, high_open: bool = False) -> list[str]:
    """low <= value <= high (or < high when `high_open`)."""
    ok = low <= value and (value < high if high_open else value <= high)
    if ok:
        return []
    return [f"{key}={value!r} must be in [{low}, {high}{')' if high_open else ']'}"]


def one_of(key: str, value, choices) -> list[str]:
    return [] if value in choices else [f"{key}={value!r} is not one of {tuple(choices)}"]
