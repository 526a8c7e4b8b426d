"""The rules by which tests/docs/test_commands.py checks and runs the commands in the docs.

A command block is a fenced ```` ```bash ```` (or `sh`, `shell`, `console`) or ```` ```python ```` block.
Its info string after the language decides what happens to it:
  (nothing)        runnable: checked without running (fast tier) and run at a small size (slow tier);
  `needs-hardware` GPUs, a cluster, hours, a network: checked, never run, listed as skipped;
  `slow`           runnable but heavy even when shrunk: run in the slow tier with a longer timeout.

What is checked without running (`problems`): each `python SCRIPT.py` names a file of the
repository, and a subcommand its script defines; each `--config=FILE` exists and each
`--config.KEY=VALUE` names a key of that config; each `pip install -e ".[EXTRA,...]"` names extras of
pyproject.toml; each `pytest -m EXPR` names registered markers and existing paths.

How a block is run (`shrink`, then `prepare` and bash in test_commands.py):
- in a fresh temporary directory holding a copy of scripts/, configs/ and every other top-level
  entry of the repository the block names (docs/, jaxpar/, tests/, ...); jaxpar itself is imported
  from this checkout (PYTHONPATH), `python` and `python3` are the test's interpreter, JAX on CPU,
  no network (HF_HUB_OFFLINE);
- venv lines (`python3 -m venv`, `. .venv/bin/activate`) are dropped: the test's interpreter is the venv;
- `pip install` is checked (above), not run; `pytest` is checked, not run (the README's suite is what
  .ci/run runs; running it here would run this test inside itself); `ruff` is not run (.ci/run runs it);
- commands are shrunk by SHRINK below: `scripts/train.py` gets `--config.train.steps=2
  --config.checkpoint.every_steps=0` (replacing values the block gives; `--cpu_devices` is kept as
  written; a run with `--config.train.profile_steps` runs through its traced steps),
  `scripts/sample.py` `--max_new_tokens=8`, benchmarks and reports one short repetition; the command
  after `launch_local.py ... --` is shrunk by its own rule;
- a block that reads a run it does not make (`runs/llama_tiny`, the Quickstart's) finds that run there,
  trained once per session by the Quickstart's command shrunk the same way.
"""

from __future__ import annotations

import itertools
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ml_collections import ConfigDict

from tests.support.markdown import Block
from tests.support.paths import REPO

SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
COMMAND_LANGUAGES = (*SHELL_LANGUAGES, "python")
NEEDS_HARDWARE, SLOW = "needs-hardware", "slow"
MARKS = (NEEDS_HARDWARE, SLOW)

STEPS = {"config.train.steps": "2", "config.checkpoint.every_steps": "0"}
PROFILE_START = 3  # train.profile_start's default: a profiled run is shrunk to end with its traced steps
# (script, subcommand or None) -> flags set (replacing the block's own values) to run it small.
SHRINK = {
    ("scripts/train.py", None): STEPS,
    ("scripts/sample.py", None): {"max_new_tokens": "8"},
    ("scripts/bench.py", "step"): {"steps": "1", "repeats": "1"},
    ("scripts/bench.py", "generate"): {"new_tokens": "8", "repeats": "1"},
    ("scripts/bench.py", "moe"): {"steps": "1", "repeats": "1"},
    ("scripts/bench.py", "packing"): {"steps": "1", "repeats": "1"},
    ("scripts/bench.py", "lora"): {"steps": "1", "repeats": "1"},
    ("scripts/bench.py", "mesh"): {"steps": "4", "repeats": "1"},
    ("scripts/bench.py", "checkpoint"): {"steps": "2", "every": "1", "repeats": "1"},
    ("scripts/bench.py", "window"): {"seq": "256", "window": "16", "repeats": "1"},
    ("scripts/bench.py", "collective_matmul"): {"sizes": "small", "steps": "1", "repeats": "1"},
    ("scripts/bench.py", "faults"): {"steps": "4", "every": "2", "at": "3", "local_every": "1", "repeats": "1"},
    ("scripts/pipeline.py", "report"): {"steps": "1"},
    ("scripts/pipeline.py", "balance"): {"steps": "1"},
    ("scripts/sweep.py", None): {"limit": "2"},
    ("scripts/fp8.py", "curves"): {"steps": "2", "recipes": "delayed"},  # fp32, bf16 and the recipe with state
    ("scripts/fp8.py", "step"): {"steps": "1", "repeats": "1", "recipes": "tensorwise"},
}
# Benchmarks whose block would repeat, at a larger size, what a test already runs with the same flags at a
# tiny size (measured in the slow tier: checkpoint 77 s, faults 60 s, lora 39 s, step 23 s, generate 10 s;
# launch_local below): checked in the fast tier, run by that test.
RUN_BY_TESTS = {
    ("scripts/bench.py", "step"): "tests/scripts/test_bench_script.py::test_step_beside_the_peer_and_profile_report_reads_its_trace",
    ("scripts/bench.py", "lora"): "tests/scripts/test_bench_script.py::test_lora_trains_the_adapters_a_closed_form_counts",
    ("scripts/bench.py", "generate"): "tests/scripts/test_bench_script.py::test_generate_cached_recomputed_and_transformers_agree",
    ("scripts/bench.py", "checkpoint"): "tests/scripts/test_bench_script.py::test_checkpoint_save_cost_per_storage",
    # 2 processes x 4 devices training (docs/clusters.md, 14 s).
    ("scripts/launch_local.py", None):
        "tests/distributed/test_multiprocess_train.py::test_two_processes_train_and_checkpoint_one_process_resumes",
    # A flag instead of a subcommand: the launch that reads a hosts file (docs/clusters.md, 19 s), lost and regained.
    ("scripts/launch_local.py", "--elastic"):
        "tests/distributed/test_restarts.py::test_a_run_loses_a_host_continues_on_one_and_grows_back",
    ("scripts/bench.py", "faults"):
        "tests/scripts/test_bench_script.py::test_faults_each_scenario_restarts_once_and_a_preemption_loses_nothing",
}
# Runs a block may read without making them: path -> the command that makes it (shrunk like any other).
PREPARED_RUNS = {
    "runs/llama_tiny": "python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/llama_tiny",
}
ALWAYS_COPIED = ("scripts", "configs")
NOT_COPIED = {".git", ".venv", "runs", "__pycache__", ".ci"}

_OPERATORS = ("&&", "||", ";", "|")
_REDIRECTION = re.compile(r"^\d*(>>?|<|>&\d*|<<<)(&\d+)?$")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    raw: str

    @property
    def script(self) -> str | None:
        """The repository script a `python SCRIPT.py ...` runs (None for anything else)."""
        if len(self.argv) >= 2 and self.argv[0] in ("python", "python3") and self.argv[1].endswith(".py"):
            return self.argv[1]
        return None


def is_command_block(block: Block) -> bool:
    return block.language in COMMAND_LANGUAGES


def mark_of(block: Block) -> str | None:
    marks = [w for w in block.words if w in MARKS]
    return marks[0] if marks else None


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined; a heredoc stays attached to its line."""
    out, pending, heredoc = [], "", None
    for line in text.splitlines():
        if heredoc is not None:
            out[-1] += "\n" + line
            if line.strip() == heredoc:
                heredoc = None
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        out.append(line)
        if match := _HEREDOC.search(line):
            heredoc = match.group(1)
    return [line for line in out if line.strip()]


def split_segments(line: str) -> list[str]:
    """A shell line cut at top-level `&&`, `||`, `;`, `|` (quotes respected), the operators kept as items."""
    items, current, quote, i = [], "", None, 0
    while i < len(line):
        ch = line[i]
        if quote:
            current += ch
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"' and i + 1 < len(line):
                current += line[i + 1]
                i += 1
        elif ch in "'\"":
            quote, current = ch, current + ch
        elif ch == "\\" and i + 1 < len(line):
            current += line[i : i + 2]
            i += 1
        elif ch == "#" and (not current or current[-1].isspace()):
            break  # a comment to the end of the line
        elif ch == "\n":
            current += line[i:]  # a heredoc body: not split
            break
        else:
            op = next((o for o in _OPERATORS if line.startswith(o, i)), None)
            if op:
                items += [current, op]
                current = ""
                i += len(op)
                continue
            current += ch
        i += 1
    items.append(current)
    return [item.strip() if item not in _OPERATORS else item for item in items]


def parse(segment: str) -> Command:
    first_line = segment.split("\n", 1)[0]
    try:
        argv = tuple(shlex.split(first_line, comments=True))
    except ValueError:
        argv = tuple(first_line.split())
    return Command(argv, segment)


def commands(block: Block) -> list[Command]:
    """Every simple command of a shell block (none for a python block)."""
    if block.language not in SHELL_LANGUAGES:
        return []
    found = []
    for line in logical_lines(block.text):
        if line.lstrip().startswith("#"):
            continue
        found += [parse(s) for s in split_segments(line) if s and s not in _OPERATORS]
    return found


def kind(command: Command) -> str:
    """venv | pip | pytest | linter | script | other."""
    argv = command.argv
    if not argv:
        return "other"
    if argv[0] in (".", "source") and argv[1:2] and argv[1].endswith("activate"):
        return "venv"
    if argv[0] in ("python", "python3") and argv[1:3] == ("-m", "venv"):
        return "venv"
    if argv[0] in ("pip", "pip3") or argv[:3] in (("python", "-m", "pip"), ("python3", "-m", "pip")):
        return "pip"
    if argv[0] == "pytest" or argv[1:3] == ("-m", "pytest"):
        return "pytest"
    if argv[0] == "ruff":
        return "linter"
    return "script" if command.script else "other"


_NAMED_COMMAND = re.compile(r"\bCommand\(\s*[\"']([\w.-]+)[\"']")


def subcommands(source: str) -> tuple[str, ...]:
    """The subcommand words a script defines: its `Command("word", ...)` records (a script whose only
    record is `Command(None, ...)` takes none)."""
    return tuple(_NAMED_COMMAND.findall(source))


def subcommand(command: Command) -> str | None:
    """The first word after the script when the script defines subcommands."""
    rest = command.argv[2:]
    if not rest or rest[0].startswith("-") or not (REPO / command.script).is_file():
        return None
    return rest[0] if subcommands((REPO / command.script).read_text()) else None


def _flag(arg: str) -> tuple[str, str | None]:
    name, has_value, value = arg[2:].partition("=")
    return name, (value if has_value else None)


def _shrunk_argv(argv: list[str]) -> list[str]:
    cut = next((i for i, a in enumerate(argv) if _REDIRECTION.match(a)), len(argv))
    if cut < len(argv):  # flags go before `> FILE` and its kind
        return _shrunk_argv(argv[:cut]) + argv[cut:]
    command = Command(tuple(argv), shlex.join(argv))
    if not command.script:
        return argv
    if command.script == "scripts/launch_local.py" and "--" in argv:
        cut = argv.index("--")
        return argv[: cut + 1] + _shrunk_argv(argv[cut + 1 :])
    rules = dict(SHRINK.get((command.script, subcommand(command)), {}))
    if command.script == "scripts/train.py":
        given = dict(_flag(a) for a in argv if a.startswith("--config.train.profile"))
        if int(given.get("config.train.profile_steps") or 0) > 0:  # run through the traced steps
            last = int(given.get("config.train.profile_start") or PROFILE_START) + int(given["config.train.profile_steps"]) - 1
            rules["config.train.steps"] = str(max(int(rules["config.train.steps"]), last))
    kept = [a for a in argv if not (a.startswith("--") and _flag(a)[0] in rules)]
    return kept + [f"--{name}={value}" for name, value in rules.items()]


def _join(argv: list[str]) -> str:
    return " ".join(a if _REDIRECTION.match(a) else shlex.quote(a) for a in argv)


def _test_running(command: Command) -> str | None:
    """RUN_BY_TESTS' test for a script command: keyed by one of its own flags (before a `--`), else by its subcommand."""
    if not command.script:
        return None
    own = itertools.takewhile(lambda a: a != "--", command.argv[2:])
    flagged = [RUN_BY_TESTS[key] for a in own if a.startswith("--") and (key := (command.script, a.partition("=")[0])) in RUN_BY_TESTS]
    return flagged[0] if flagged else RUN_BY_TESTS.get((command.script, subcommand(command)))


def run_by_tests(block: Block) -> tuple[str, ...]:
    """The tests that run this block's commands (RUN_BY_TESTS) when every command of it has one; else ().
    An `echo` that writes a file for the next command (a hosts file) needs no test of its own."""
    found = [c for c in commands(block) if kind(c) not in ("venv", "pip") and c.argv[:1] != ("echo",)]
    tests = [_test_running(c) for c in found]
    return tuple(tests) if found and all(tests) else ()


def shrink_segment(segment: str) -> str:
    command = parse(segment)
    what = kind(command)
    if what in ("venv", "pip", "pytest", "linter"):
        return f"true  # checked, not run: {command.argv[0]} ..."
    if what != "script" or "\n" in segment:  # a heredoc feeds python itself: nothing to shrink
        return segment
    return _join(_shrunk_argv(list(command.argv)))


def shrink(block: Block) -> str:
    """The block as the slow tier runs it (a bash script, or the python program unchanged)."""
    if block.language == "python":
        return block.text
    lines = []
    for line in logical_lines(block.text):
        if line.lstrip().startswith("#"):
            continue
        items = split_segments(line)
        lines.append(" ".join(item if item in _OPERATORS else shrink_segment(item) for item in items if item))
    return "set -euo pipefail\n" + "\n".join(lines) + "\n"


def copied_paths(block: Block, root: Path = REPO) -> list[str]:
    """Top-level entries of the repository a block needs in its temporary copy."""
    named = {m.group(1) for m in re.finditer(r"(?<![\w./-])([\w.-]+)(?=/|\b)", block.text)}
    entries = {p.name for p in root.iterdir()} - NOT_COPIED
    return sorted(set(ALWAYS_COPIED) | (named & entries))


def prepared_runs(block: Block) -> list[str]:
    """The PREPARED_RUNS a block reads but does not make itself."""
    made = {_flag(a)[1] for c in commands(block) if c.script == "scripts/train.py" for a in c.argv if a.startswith("--workdir=")}
    return [run for run in PREPARED_RUNS if run in block.text and run not in made]


# -- checks without running ------------------------------------------------------------------------


def _pyproject(root: Path = REPO) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())


def extras(root: Path = REPO) -> set[str]:
    return set(_pyproject(root).get("project", {}).get("optional-dependencies", {}))


def markers(root: Path = REPO) -> set[str]:
    declared = _pyproject(root).get("tool", {}).get("pytest", {}).get("ini_options", {}).get("markers", [])
    return {line.split(":", 1)[0].split("(", 1)[0].strip() for line in declared}


def flat_keys(config, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in config.items():
        keys.add(prefix + name)
        if isinstance(value, ConfigDict):
            keys |= flat_keys(value, f"{prefix}{name}.")
    return keys


_CONFIG_KEYS: dict[str, set[str]] = {}


def config_keys(spec: str, root: Path = REPO) -> set[str]:
    """Every key of `--config=FILE[:ARG]`'s get_config() (read once per file)."""
    if spec not in _CONFIG_KEYS:
        import importlib.util

        path, _, arg = spec.partition(":")
        module_spec = importlib.util.spec_from_file_location(f"_docs_config_{len(_CONFIG_KEYS)}", root / path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        _CONFIG_KEYS[spec] = flat_keys(module.get_config(arg) if arg else module.get_config())
    return _CONFIG_KEYS[spec]


def _script_problems(argv: list[str], root: Path) -> list[str]:
    command = Command(tuple(argv), shlex.join(argv))
    if not command.script:
        return []
    script = command.script
    if not (root / script).is_file():
        return [f"{script} does not exist"]
    problems = []
    source = (root / script).read_text()
    rest = argv[2:]
    if words := subcommands(source):
        if not rest or rest[0].startswith("-"):
            problems.append(f"{script} takes a subcommand first ({', '.join(words)})")
        elif rest[0] not in words:
            problems.append(f"{script} has no subcommand {rest[0]!r} ({', '.join(words)})")
    if script == "scripts/launch_local.py" and "--" in argv:
        problems += _script_problems(argv[argv.index("--") + 1 :], root)
        argv = argv[: argv.index("--")]
    specs = [_flag(a)[1] for a in argv if a.startswith("--config=")]
    for spec in specs:
        if not (root / spec.partition(":")[0]).is_file():
            problems.append(f"{script}: --config={spec} does not exist")
            continue
        keys = config_keys(spec, root)
        for arg in argv:
            name = _flag(arg)[0] if arg.startswith("--config.") else None
            if name and name[len("config."):] not in keys:
                problems.append(f"{script}: --{name} is not a key of {spec}")
    return problems


def _pip_problems(argv: tuple[str, ...], root: Path) -> list[str]:
    known, problems = extras(root), []
    for arg in argv:
        match = re.match(r"^(?:\.|jaxpar)\[([^\]]*)\]$", arg)
        for extra in (e.strip() for e in (match.group(1).split(",") if match else ())):
            if extra and extra not in known:
                problems.append(f"pip install: the extra [{extra}] is not in pyproject.toml ({', '.join(sorted(known))})")
    return problems


def _pytest_problems(argv: tuple[str, ...], root: Path) -> list[str]:
    start = 1 if argv[0] == "pytest" else 3
    problems, registered, i = [], markers(root), start
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "-k", "-n", "-p", "--timeout", "--durations") and i + 1 < len(argv):
            if arg == "-m":
                words = set(re.findall(r"[A-Za-z_]\w*", argv[i + 1])) - {"and", "or", "not"}
                problems += [f"pytest -m: marker {w!r} is not registered in pyproject.toml" for w in sorted(words - registered)]
            i += 2
            continue
        if not arg.startswith("-") and not (root / arg.split("::")[0]).exists():
            problems.append(f"pytest: {arg} does not exist")
        i += 1
    return problems


def problems(block: Block, root: Path = REPO) -> list[str]:
    """What is wrong with a command block, found without running it (one line each)."""
    if block.language == "python":
        try:
            compile(block.text, block.name, "exec")
        except SyntaxError as e:
            return [f"{block.name}: python syntax error at line {e.lineno}: {e.msg}"]
        return []
    found = []
    for command in commands(block):
        what = kind(command)
        if what == "script":
            found += _script_problems(list(command.argv), root)
        elif what == "pip":
            found += _pip_problems(command.argv, root)
        elif what == "pytest":
            found += _pytest_problems(command.argv, root)
    return [f"{block.name}: {p}" for p in found]
