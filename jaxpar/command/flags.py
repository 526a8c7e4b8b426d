"""Flags as every script reads them: `--name=value`, `--name value`, bare `--name` / `--noname` for
booleans, `--config.KEY=VALUE` overrides collected aside, and positional words where a command
declares them. Every problem is one line naming the flag (with the nearest known name for a typo);
the caller prints them all and exits 2.

Written here rather than with argparse, which prints its usage block before every error (the
contract is one line per problem), spells negated booleans `--no-name`, and reads
`--config.train.steps=5` overrides only through `parse_known_args` and a second pass; the loop below
is the whole of what argparse would have needed around it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


class UsageError(ValueError):
    """Bad command line or input: one line per problem, exit code 2."""


@dataclass(frozen=True)
class Flag:
    """One flag of a command."""

    name: str
    kind: type = str  # str | int | float | bool | list (comma-separated words)
    default: Any = None
    help: str = ""
    choices: tuple = ()  # the values allowed (each of a list flag's words)
    required: bool = False
    repeat: bool = False  # may be given several times; the value is the list of them
    positional: bool = False  # given as a bare word, in declaration order
    at_least: float | None = None  # the smallest allowed number

    def initial(self):
        if self.repeat:
            return list(self.default or ())
        if self.kind is list and isinstance(self.default, str):
            return [w for w in self.default.split(",") if w]
        return list(self.default) if self.kind is list and self.default is not None else self.default

    def usage(self) -> str:
        if self.positional:
            return self.name.upper()
        if self.kind is bool:
            return f"--[no]{self.name}"
        return f"--{self.name}={self.kind.__name__.upper() if self.kind is not list else 'A,B,...'}"


def parse_value(flag: str, text: str, kind):
    """`text` as `kind`; UsageError naming `flag` when it is not one."""
    if kind is bool:
        if text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        raise UsageError(f"{flag}={text!r} must be true or false")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise UsageError(f"{flag}={text!r} must be {'an integer' if kind is int else 'a number'}") from None
    if kind is list:
        return [w.strip() for w in text.split(",") if w.strip()]
    return text


def _checked(flag: Flag, value) -> list[str]:
    problems = []
    words = value if flag.kind is list else [value]
    if flag.choices:
        problems += [f"--{flag.name}={w}: not one of {', '.join(map(str, flag.choices))}" for w in words if w not in flag.choices]
    if flag.at_least is not None and flag.kind in (int, float) and value is not None and value < flag.at_least:
        bound = int(flag.at_least) if flag.kind is int else flag.at_least
        problems.append(f"--{flag.name}={value} must be >= {bound}")
    return problems


def parse(argv: list[str], flags: tuple[Flag, ...]) -> tuple[SimpleNamespace, list[tuple[str, str]], list[str]]:
    """(values by flag name, `--config.KEY=VALUE` overrides as (KEY, VALUE), problems)."""
    table = {f.name: f for f in flags if not f.positional}
    positional = [f for f in flags if f.positional]
    values = SimpleNamespace(**{f.name: f.initial() for f in flags})
    given: set[str] = set()
    overrides, problems, words, i = [], [], [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            words.append(arg)
            continue
        name, has_value, text = arg[2:].partition("=")
        if name.startswith("config."):  # kept aside even where there is no --config: the caller says why not
            if not has_value:
                if i >= len(argv):
                    problems.append(f"--{name} needs a value (--{name}=VALUE)")
                    continue
                text, i = argv[i], i + 1
            overrides.append((name[len("config."):], text))
            continue
        negated = name.startswith("no") and name[2:] in table and table[name[2:]].kind is bool
        key = name[2:] if negated else name
        flag = table.get(key)
        if flag is None:
            near = difflib.get_close_matches(key, list(table), n=1)
            known = f"; did you mean --{near[0]}?" if near else f" (known: --{', --'.join(table)})"
            problems.append(f"unknown flag --{key}{known}")
            continue
        if flag.kind is bool and not has_value:
            setattr(values, key, not negated)
            given.add(key)
            continue
        if not has_value:
            if i >= len(argv):
                problems.append(f"--{key} needs a value (--{key}=VALUE)")
                continue
            text, i = argv[i], i + 1
        try:
            value = parse_value(f"--{key}", text, flag.kind)
        except UsageError as e:
            problems.append(str(e))
            continue
        problems += _checked(flag, value)
        if flag.repeat:
            getattr(values, key).append(value)
        else:
            setattr(values, key, value)
        given.add(key)
    for flag, word in zip(positional, words):
        try:
            value = parse_value(flag.name.upper(), word, flag.kind)
            setattr(values, flag.name, value)
            problems += _checked(flag, value)
            given.add(flag.name)
        except UsageError as e:
            problems.append(str(e))
    if len(words) > len(positional):
        extra = " ".join(repr(w) for w in words[len(positional):])
        problems.append(f"unexpected argument {extra}; flags look like --name=value")
    problems += [
        f"{f.name.upper()} is required" if f.positional else f"--{f.name} is required"
        for f in flags if f.required and f.name not in given
    ]
    return values, overrides, problems
