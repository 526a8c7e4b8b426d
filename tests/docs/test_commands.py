"""Every command in README.md, CONTRIBUTING.md and docs/**/*.md runs, or says why it cannot here
(issue 34 item 4).

Fenced ```` ```bash ```` and ```` ```python ```` blocks are commands; ```` ```bash needs-hardware ````
ones (GPUs, clusters, hours) are never run and are listed as skipped, ```` ```bash slow ```` ones run
only in the slow tier, with a longer timeout. Fast tier: every block is checked without running it
(its scripts, subcommands, config files and keys, pip extras, pytest markers exist). Slow tier:
every runnable block runs at a small size in a fresh temporary copy of what it names, on CPU.
A block whose every command a named test already runs (rules.RUN_BY_TESTS) is checked, not run
again; so is a block that repeats an earlier one word for word. The rules (what is copied, how
commands are shrunk, which runs are prepared) are in `tests/support/doc_commands.py`; the
Quickstart's second command (the whole suite) is checked, not run: .ci/run runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from tests.support import doc_commands as rules
from tests.support.compile_flags import subprocess_environment
from tests.support.markdown import Block, blocks, documents
from tests.support.paths import REPO

RUN_TIMEOUT_S, SLOW_RUN_TIMEOUT_S = 280, 880

BLOCKS = [
    block
    for path in documents()
    for block in blocks(path.read_text(), str(path.relative_to(REPO)))
    if rules.is_command_block(block)
]
HARDWARE = [b for b in BLOCKS if rules.mark_of(b) == rules.NEEDS_HARDWARE]
RUN_BY_TESTS = [b for b in BLOCKS if rules.run_by_tests(b)]
RUNNABLE = [b for b in BLOCKS if rules.mark_of(b) != rules.NEEDS_HARDWARE and not rules.run_by_tests(b)]
# A block whose commands repeat an earlier block's word for word (the README and a guide showing the
# same plan.py answer) is run once, where it first appears.
FIRST = {}
for _block in RUNNABLE:
    FIRST.setdefault(_block.text.strip(), _block)
RUNNABLE = [b for b in RUNNABLE if FIRST[b.text.strip()] is b]


def _case(block: Block):
    marks = [pytest.mark.slow]
    if "launch_local.py" in block.text:
        marks.append(pytest.mark.multiprocess)
    if rules.mark_of(block) == rules.SLOW:
        marks.append(pytest.mark.timeout(SLOW_RUN_TIMEOUT_S + 20))
    return pytest.param(block, id=block.name, marks=marks)


def _copy(entry: str, into: Path) -> None:
    source = REPO / entry
    if source.is_dir():
        shutil.copytree(source, into / entry, ignore=shutil.ignore_patterns(*rules.NOT_COPIED, "*.pyc"))
    else:
        shutil.copy2(source, into / entry)


def run_block(block: Block, directory: Path, prepared=lambda run: None, timeout: float = RUN_TIMEOUT_S):
    """Runs a block as the slow tier does (the rules in tests/support/doc_commands.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in rules.copied_paths(block):
        _copy(entry, directory)
    for run in rules.prepared_runs(block):
        shutil.copytree(prepared(run), directory / run)
    shims = directory / ".bin"
    shims.mkdir()
    for name in ("python", "python3"):  # a script, not a link: a linked venv python forgets its venv
        (shims / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (shims / name).chmod(0o755)
    env = subprocess_environment(
        PATH=f"{shims}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
    )
    if block.language == "python":
        program, argv = directory / "block.py", [sys.executable, "block.py"]
    else:
        program, argv = directory / "block.sh", ["bash", "block.sh"]
    program.write_text(rules.shrink(block))
    return subprocess.run(argv, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout)


def _report(block: Block, result) -> str:
    return (
        f"{block.name} exited {result.returncode}\n--- as run:\n{rules.shrink(block)}"
        f"--- stdout (end):\n{result.stdout[-3000:]}\n--- stderr (end):\n{result.stderr[-3000:]}"
    )


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, worker_id):
    """`prepared(run)`: the folder of a PREPARED_RUNS run, made once per session (all xdist workers share it)."""
    root = tmp_path_factory.getbasetemp()
    root = (root if worker_id == "master" else root.parent) / "docs_runs"
    root.mkdir(exist_ok=True)

    def make(run: str) -> Path:
        home = root / run.replace("/", "_")
        with FileLock(str(home) + ".lock"):
            if not (home / run).is_dir():
                shutil.rmtree(home, ignore_errors=True)
                maker = Block("<prepared>", 0, "bash", (), rules.PREPARED_RUNS[run] + "\n")
                result = run_block(maker, home)
                assert result.returncode == 0, _report(maker, result)
        return home / run

    return make


def test_the_docs_have_commands():
    readme = [b for b in BLOCKS if b.path == "README.md"]
    assert len(readme) >= 2 and len(BLOCKS) >= 10, [b.name for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_is_well_formed(block):
    assert rules.problems(block) == []


@pytest.mark.parametrize("block", HARDWARE, ids=lambda b: b.name)
def test_needs_hardware_blocks_are_listed(block):
    first = next((c.raw for c in rules.commands(block)), block.text.strip().splitlines()[0])
    pytest.skip(f"needs-hardware, not run here: {' '.join(first.split())[:100]}")


@pytest.mark.parametrize("block", RUN_BY_TESTS, ids=lambda b: b.name)
def test_blocks_a_test_runs_name_tests_that_exist(block):
    """A block left to a test (rules.RUN_BY_TESTS) names a test that is there to run it."""
    for test in rules.run_by_tests(block):
        path, _, name = test.partition("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), flags=re.M), f"{block.name}: {test} does not exist"


@pytest.mark.parametrize("block", [_case(b) for b in RUNNABLE])
def test_block_runs(block, tmp_path, prepared):
    timeout = SLOW_RUN_TIMEOUT_S if rules.mark_of(block) == rules.SLOW else RUN_TIMEOUT_S
    result = run_block(block, tmp_path / "repo", prepared, timeout)
    assert result.returncode == 0, _report(block, result)


# -- the rules themselves, each shown to catch what it is for --------------------------------------


def _block(text: str, language: str = "bash", *words: str) -> Block:
    return Block("planted.md", 1, language, words, text)


def test_checks_find_planted_mistakes():
    good = _block(
        'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
        "python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/x --config.train.steps=3\n"
    )
    assert rules.problems(good) == []
    planted = {
        "python scripts/no_such_script.py --flag=1": "does not exist",
        'pip install -e ".[no_such_extra]"': "[no_such_extra]",
        "python scripts/train.py --config=configs/no_such.py --workdir=x": "configs/no_such.py does not exist",
        "python scripts/train.py --config=configs/llama_tiny.py --workdir=x --config.train.no_such_key=1": "no_such_key",
        'pytest -m "not no_such_marker" tests': "no_such_marker",
        "pytest tests/no_such_folder": "does not exist",
        "python scripts/launch_local.py --processes=2 -- python scripts/train.py --config=configs/no_such.py --workdir=x": "no_such",
    }
    for text, expected in planted.items():
        found = rules.problems(_block(text + "\n"))
        assert len(found) == 1 and expected in found[0], (text, found)
    assert rules.problems(_block("print(\n", "python")), "a python syntax error is found"


def test_subcommands_are_the_named_command_records():
    """A script with one `Command(None, ...)` takes no subcommand word (scripts/train.py); one with
    named records takes one of their names first."""
    assert rules.subcommands('COMMANDS = (Command(None, "train a model", run, flags=FLAGS),)') == ()
    several = 'COMMANDS = (\n    Command("report", "time them", report),\n    Command(\n        "balance", "split", balance),\n)'
    assert rules.subcommands(several) == ("report", "balance")


def test_shrinking_rules():
    block = _block(
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && \\\n"
        "  python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/a --config.train.steps=50 --cpu_devices=8\n"
        "python scripts/sample.py --workdir=runs/llama_tiny --prompt='def ' --max_new_tokens=200 > out.txt\n"
        "python scripts/launch_local.py --processes=2 -- python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/b\n"
        "grep eval_loss runs/a/metrics.jsonl | head -n 1  # a comment\n"
    )
    script = rules.shrink(block)
    train, sample, launch, grep = script.splitlines()[1:]
    assert train.startswith("true") and "pip" in train and "--config.train.steps=50" not in train
    assert train.endswith("--cpu_devices=8 --config.train.steps=2 --config.checkpoint.every_steps=0")
    assert "200" not in sample and sample.endswith("--max_new_tokens=8 > out.txt")  # a redirection stays last
    assert "'--prompt=def '" in sample  # the space stays quoted
    assert launch.endswith("--workdir=runs/b --config.train.steps=2 --config.checkpoint.every_steps=0")
    assert grep == "grep eval_loss runs/a/metrics.jsonl | head -n 1"
    assert rules.prepared_runs(block) == ["runs/llama_tiny"]
    makes_it = _block("python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/llama_tiny\n")
    assert rules.prepared_runs(makes_it) == []
    profiled = _block("python scripts/train.py --config=configs/llama_tiny.py --workdir=p --config.train.profile_steps=2\n")
    assert "--config.train.steps=4 " in rules.shrink(profiled)  # through the traced steps 3 and 4
    assert rules.copied_paths(_block("ls docs/figures jaxpar\n")) == ["configs", "docs", "jaxpar", "scripts"]


def test_a_failing_block_fails(tmp_path):
    """The runner reports a command's failure (here a planted exit 3 after a passing command)."""
    result = run_block(_block('python -c "print(1)" && python -c "import sys; sys.exit(3)"\necho never\n'), tmp_path / "r")
    assert result.returncode == 3 and "never" not in result.stdout, result


def test_a_block_is_left_to_a_test_by_its_script_and_subcommand_or_flag():
    train = "-- python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/x\n"
    elastic = _block("echo 2 > hosts.txt\npython scripts/launch_local.py --processes=2 --elastic --hosts_file=hosts.txt " + train)
    assert rules.run_by_tests(elastic) == (rules.RUN_BY_TESTS[("scripts/launch_local.py", "--elastic")],)
    plain = _block("python scripts/launch_local.py --processes=2 " + train)
    assert rules.run_by_tests(plain) == (rules.RUN_BY_TESTS[("scripts/launch_local.py", None)],)
    # A flag of the launched command (after `--`) is not the launcher's; any other command runs the block.
    assert rules.run_by_tests(_block("python scripts/launch_local.py --processes=2 -- python scripts/train.py --elastic\n")) == (
        rules.RUN_BY_TESTS[("scripts/launch_local.py", None)],)
    assert rules.run_by_tests(_block("cat hosts.txt\npython scripts/launch_local.py --elastic " + train)) == ()
