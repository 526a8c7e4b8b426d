"""The command line of scripts/train.py: flags, the config file, `--config.KEY=VALUE` overrides.

Every bad input is a `UsageError` whose message is one line per problem naming the flag, key or
file (the nearest known name when it looks like a typo) — never a traceback. Values of overrides
are parsed by the type of the key they replace (bool, int, float, str; "None" for optional keys).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass, field

from ml_collections import ConfigDict

from jaxpar.train.preflight import flat_keys, nearest_key

USAGE = """usage: train.py --config=CONFIG.py[:ARG] --workdir=DIR [--config.SECTION.KEY=VALUE ...]
                [--overwrite] [--cpu_devices=N] [--plan=HARDWARE] [--coordinator=HOST:PORT --num_processes=N --process_id=I]

  --config          a configs/*.py file defining get_config() (ARG is passed to it if given)
  --workdir         where config.json, metrics.jsonl, checkpoints/ and the run's lock live; a workdir
                    holding a run with a fitting checkpoint is resumed, any other earlier run refused
  --overwrite       replace an earlier run in --workdir: moved aside once the new run is known to
                    start, deleted at the new run's first checkpoint, put back if it fails before
  --cpu_devices     emulate N CPU devices (0: the real devices; JAX_NUM_CPU_DEVICES wins if set)
  --plan            a hardware profile (a100-80g, h100-80g, h200, tpu-v5p, ...): set the mesh, ZeRO
                    stage, remat and microbatch keys to the planner's best layout for the visible
                    device count, printing the choice and why; --config.KEY=VALUE still wins
  --coordinator, --num_processes, --process_id
                    join a multi-process run (else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
                    JAX_PROCESS_ID, else a SLURM job step with several tasks, else one process)
"""

# flag name -> type; bools may be given bare (--overwrite) or negated (--nooverwrite).
FLAGS = {
    "config": str, "workdir": str, "overwrite": bool, "cpu_devices": int,
    "coordinator": str, "num_processes": int, "process_id": int, "plan": str, "help": bool,
}
REQUIRED = ("config", "workdir")
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


class UsageError(ValueError):
    """Bad command line or config file; one line per problem."""


@dataclass
class Args:
    config: str = ""
    workdir: str = ""
    overwrite: bool = False
    cpu_devices: int = 0
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    plan: str = ""  # a hardware name (jaxpar.analysis.cost.hardware): fill the layout keys from the planner
    help: bool = False
    overrides: list[tuple[str, str]] = field(default_factory=list)  # ("train.steps", "3")


def _parse_value(flag: str, text: str, kind):
    if kind is bool:
        if text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        raise UsageError(f"{flag}={text!r} must be true or false")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise UsageError(f"{flag}={text!r} must be {'an int' if kind is int else 'a number'}") from None
    return text


def parse(argv: list[str]) -> Args:
    """Flags and overrides from `argv` (without the program name); UsageError lists every problem."""
    args, problems = _parse(argv)
    if problems:
        raise UsageError("\n".join(problems))
    return args


def parse_flags(argv: list[str], flags: dict, values) -> tuple[list[tuple[str, str]], list[str]]:
    """Sets `values.<flag>` from `--flag=value` / `--flag value` / `--[no]flag` (bools) for the
    `flags` table (name -> type); returns the `--config.KEY=VALUE` overrides and the problems."""
    overrides, problems, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            problems.append(f"unexpected argument {arg!r}; flags look like --name=value")
            continue
        name, has_value, value = arg[2:].partition("=")
        if name.startswith("config."):
            if not has_value:
                if i >= len(argv):
                    problems.append(f"--{name} needs a value (--{name}=VALUE)")
                    continue
                value, i = argv[i], i + 1
            overrides.append((name[len("config."):], value))
            continue
        negated = name.startswith("no") and flags.get(name[2:]) is bool
        key = name[2:] if negated else name
        if key not in flags:
            near = difflib.get_close_matches(key, flags, n=1)
            problems.append(f"unknown flag --{key}" + (f"; did you mean --{near[0]}?" if near else f" (known: --{', --'.join(flags)})"))
            continue
        kind = flags[key]
        if kind is bool and not has_value:
            setattr(values, key, not negated)
            continue
        if not has_value:
            if i >= len(argv):
                problems.append(f"--{key} needs a value (--{key}=VALUE)")
                continue
            value, i = argv[i], i + 1
        try:
            setattr(values, key, _parse_value(f"--{key}", value, kind))
        except UsageError as e:
            problems.append(str(e))
    return overrides, problems


def _parse(argv: list[str]) -> tuple[Args, list[str]]:
    args = Args()
    args.overrides, problems = parse_flags(argv, FLAGS, args)
    if args.help:
        return args, []
    problems += [f"--{name} is required" for name in REQUIRED if not getattr(args, name)]
    if args.cpu_devices < 0:
        problems.append(f"--cpu_devices={args.cpu_devices} must be >= 0 (0: the real devices)")
    return args, problems


def read(argv: list[str]) -> tuple[Args, ConfigDict | None]:
    """Flags, the config file and its overrides; one UsageError listing every problem of the three."""
    args, problems = _parse(argv)
    if args.help:
        return args, None
    config = None
    if args.config:
        try:
            config = load_config(args.config)
            apply_overrides(config, args.overrides)
        except UsageError as e:
            problems.append(str(e))
    if problems:
        raise UsageError("\n".join(problems))
    return args, config


def _where(error: BaseException, path: str) -> str:
    """" at line N" of the innermost frame of `path` in the error's traceback, if any."""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if os.path.abspath(frame.filename) == path]
    return f" at line {lines[-1]}" if lines else ""


def load_config(spec: str) -> ConfigDict:
    """The ConfigDict of `--config=FILE[:ARG]`: FILE's get_config() (or get_config(ARG))."""
    path, _, arg = spec.partition(":")
    flag = f"--config={spec}"
    if not os.path.exists(path):
        raise UsageError(f"{flag}: {path} does not exist")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: {path} is not a file")
    path = os.path.abspath(path)
    module_spec = importlib.util.spec_from_file_location(f"_jaxpar_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        with open(path) as f:
            source = f.read()
        code = compile(source, path, "exec")
    except SyntaxError as e:
        raise UsageError(f"{flag}: syntax error in {path} at line {e.lineno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag}: cannot read {path} ({type(e).__name__}: {e})") from None
    sys.modules[module_spec.name] = module
    try:
        exec(code, module.__dict__)
        get_config = module.__dict__.get("get_config")
        if not callable(get_config):
            raise UsageError(f"{flag}: {path} defines no get_config() function")
        config = get_config(arg) if arg else get_config()
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - any error in the user's file becomes one line naming it
        first = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"{flag}: {path}{_where(e, path)} raised {type(e).__name__}: {first}") from None
    finally:
        sys.modules.pop(module_spec.name, None)
    if not isinstance(config, ConfigDict):
        raise UsageError(f"{flag}: get_config() in {path} returned a {type(config).__name__}, not an ml_collections ConfigDict")
    return config


def apply_overrides(config: ConfigDict, overrides: list[tuple[str, str]], known: list[str] | None = None) -> None:
    """Sets each `--config.KEY=VALUE`; raises UsageError listing every unknown key or bad value.
    `known`: the key names to suggest from (default: the config's own)."""
    problems = []
    known = known if known is not None else flat_keys(config)
    for key, text in overrides:
        flag = f"--config.{key}"
        *sections, leaf = key.split(".")
        node = config
        for section in sections:
            node = node.get(section) if isinstance(node, ConfigDict) else None
        if not isinstance(node, ConfigDict) or leaf not in node:
            near = nearest_key(key, known)
            problems.append(f"{flag}: unknown config key" + (f"; did you mean --config.{near}?" if near else ""))
            continue
        if isinstance(node[leaf], ConfigDict):
            problems.append(f"{flag}: {key} is a section; set one of its keys ({', '.join(sorted(node[leaf].keys()))})")
            continue
        kind = node.get_type(leaf)
        try:
            # None is accepted anywhere here; preflight's type check refuses it where a key needs a value.
            node[leaf] = None if text in ("None", "null") else _parse_value(flag, text, kind)
        except UsageError as e:
            problems.append(str(e))
        except (TypeError, ValueError) as e:
            problems.append(f"{flag}={text!r}: {e}")
    if problems:
        raise UsageError("\n".join(problems))
