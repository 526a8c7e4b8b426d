"""How every script in scripts/ reads its command line and ends: one record per command.

    COMMANDS = (
        Command("report", "time each schedule on emulated devices", run_report,
                flags=(Flag("stages", int, 4, "pipeline ranks p", at_least=1), ...)),
        Command("balance", ...),
    )
    if __name__ == "__main__":
        sys.exit(main(__doc__, COMMANDS))

A script with one command gives one record named None; with several, the first word picks one
(`scripts/pipeline.py report --stages=4`). `--help` prints the script's docstring and the flags.
`config="required"` or `"optional"` adds `--config=FILE[:ARG]` with `--config.KEY=VALUE` overrides
(`jaxpar.command.config_file`); `devices=True` (the default) adds `--cpu_devices=N`, applied before
JAX starts. `rest=True` takes the words after `--` as `args.rest`; `args.overrides` lists the
`--config.KEY=VALUE` pairs as given.

`run(args, config)` returns the exit code (None: 0). Bad input is `UsageError` (raised by `run` or
found while parsing, several problems at once): one `error:` line each on stderr, exit 2, before
anything was written. Ctrl-C that `run` does not handle
itself: 130.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxpar.command.flags import Flag, UsageError, parse

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130
CPU_DEVICES = Flag("cpu_devices", int, 0, "emulate N CPU devices (0: the real devices; JAX_NUM_CPU_DEVICES wins if set)", at_least=0)
HELP = Flag("help", bool, False, "print this help and exit")


@dataclass(frozen=True)
class Command:
    name: str | None  # the subcommand word; None: the script's only command
    help: str  # one line
    run: Callable  # (args, config or None) -> exit code or None
    flags: tuple[Flag, ...] = ()
    config: str = ""  # "" | "optional" | "required": --config=FILE and its --config.KEY=VALUE overrides
    default_config: str = ""  # the config file used when --config is not given
    devices: bool = True  # --cpu_devices=N
    rest: bool = False  # the words after `--` go to args.rest
    checks: Callable | None = None  # args -> one line per problem among flags that only make sense together

    def all_flags(self) -> tuple[Flag, ...]:
        extra = []
        if self.config:
            extra.append(Flag("config", str, self.default_config, "a configs/*.py file ([:ARG] is passed to its get_config)",
                              required=self.config == "required" and not self.default_config))
        if self.devices:
            extra.append(CPU_DEVICES)
        return (*self.flags, *extra, HELP)


def error(message) -> int:
    """Prints each line of `message` as `error: LINE` on stderr; returns exit code 2."""
    for line in str(message).splitlines():
        print(f"error: {line}", file=sys.stderr)
    sys.stderr.flush()
    return EXIT_USAGE


def use_cpu_devices(count: int) -> None:
    """Makes the CPU pose as `count` devices (before JAX creates its backends); 0: the real devices."""
    if count and not os.environ.get("JAX_NUM_CPU_DEVICES"):
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)


def help_text(doc: str, commands: Sequence[Command], command: Command | None) -> str:
    if command is None:
        width = max(len(c.name) for c in commands)
        listed = "\n".join(f"  {c.name.ljust(width)}  {c.help}" for c in commands)
        return f"{doc.rstrip()}\n\ncommands (SCRIPT COMMAND --help for its flags):\n{listed}\n"
    lines = []
    for flag in command.all_flags():
        default = "" if flag.default in (None, "", (), []) or flag.kind is bool and not flag.default else f" (default: {flag.default})"
        lines.append(f"  {flag.usage()}\n" + textwrap.fill(flag.help + default, 100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    title = f"{command.name}: {command.help}" if command.name else command.help
    head = doc.rstrip() if command.name is None else title
    return f"{head}\n\nflags:\n" + "\n".join(lines) + "\n"


def _pick(commands: Sequence[Command], argv: list[str]) -> tuple[Command | None, list[str]]:
    if len(commands) == 1 and commands[0].name is None:
        return commands[0], argv
    names = [c.name for c in commands]
    if not argv or argv[0].startswith("-"):
        if argv and argv[0] in ("--help", "-h"):
            return None, argv
        raise UsageError(f"give a command first: one of {', '.join(names)}")
    chosen = next((c for c in commands if c.name == argv[0]), None)
    if chosen is None:
        raise UsageError(f"unknown command {argv[0]!r}; one of {', '.join(names)}")
    return chosen, argv[1:]


def main(doc: str, commands: Sequence[Command], argv: list[str] | None = None) -> int:
    """Parses `argv` (default: sys.argv[1:]) for one of `commands` and runs it; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command, argv = _pick(commands, argv)
        if command is None:
            print(help_text(doc, commands, None))
            return 0
        rest = []
        if command.rest and "--" in argv:
            split = argv.index("--")
            argv, rest = argv[:split], argv[split + 1 :]
        args, overrides, problems = parse(argv, command.all_flags())
        if args.help:
            print(help_text(doc, commands, command))
            return 0
        if overrides and not command.config:
            problems.append(f"--config.{overrides[0][0]}: this command takes no config")
        if command.rest:
            args.rest = rest
        if command.config:
            args.overrides = overrides  # [(KEY, VALUE)] as given: what the user set explicitly
        if not problems and command.checks is not None:
            problems += command.checks(args)
        config = None
        if command.config and args.config:
            from jaxpar.command.config_file import apply_overrides, load_config

            try:
                config = load_config(args.config)
                apply_overrides(config, overrides)
            except UsageError as e:
                problems.append(str(e))
        if problems:
            raise UsageError("\n".join(problems))
        if command.devices:
            use_cpu_devices(args.cpu_devices)
    except UsageError as e:
        return error(e)
    except KeyboardInterrupt:
        print("interrupted before the command started; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    try:
        code = command.run(args, config)
    except UsageError as e:
        return error(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0 if code is None else code
