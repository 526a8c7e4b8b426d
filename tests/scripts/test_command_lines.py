"""Every script in scripts/ reads its command line one way (`jaxpar.command`): `--help` prints its
docstring (and each command's flags) and exits 0; a bad flag or a missing command word is `error:`
lines on stderr, one naming the problem, exit code 2, nothing on stdout. Each script runs in process
(`main(argv)`): nothing here starts JAX's backends.

The independent reference is the contract itself, as the developers' guide states it; a script that
went back to argparse or absl would print a usage block (not `error:` lines) and fail here.
"""

import importlib.util
import os
import sys

import pytest

from tests.support.paths import REPO

SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py"))


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name[:-3]}", REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def words(module) -> list[str]:
    return [c.name for c in module.COMMANDS if c.name is not None]


def test_every_script_is_here():
    assert {"train.py", "sample.py", "convert.py", "launch_local.py", "bench.py", "pipeline.py", "plan.py"} <= set(SCRIPTS)
    assert not [s for s in SCRIPTS if s.startswith(("bench_", "pipeline_"))], "merged into bench.py and pipeline.py"


def test_no_script_reads_flags_another_way_or_imports_tests():
    for name in SCRIPTS:
        source = (REPO / "scripts" / name).read_text()
        for other in ("import argparse", "from absl import", "config_flags", "sys.path.insert", "from tests", "import tests"):
            assert other not in source, f"scripts/{name}: {other}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_and_a_bad_flag(name, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    module = load(name)
    assert module.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(module.__doc__.strip().splitlines()[0]), out[:300]
    commands = words(module)
    for word in commands:
        assert module.main([word, "--help"]) == 0
        help_text = capsys.readouterr().out
        assert help_text.startswith(f"{word}: ") and "\nflags:\n" in help_text and "--[no]help" in help_text, help_text[:300]
    argv = [commands[0], "--no_such_flag=1"] if commands else ["--no_such_flag=1"]
    assert module.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and lines and all(line.startswith("error: ") for line in lines), captured
    assert "error: unknown flag --no_such_flag" in lines[0], lines
    if commands:
        assert module.main(["--no_such_flag"]) == 2
        assert capsys.readouterr().err == f"error: give a command first: one of {', '.join(commands)}\n"
        assert module.main(["no_such_command"]) == 2
        assert capsys.readouterr().err.startswith("error: unknown command 'no_such_command'")


def test_launch_local_needs_a_command_after_the_separator(capsys):
    launch = load("launch_local.py")
    assert launch.main(["--processes=2"]) == 2
    assert capsys.readouterr().err == "error: give the command to run after --: launch_local.py --processes=N -- COMMAND ...\n"
    assert launch.main(["--processes=0", "--", sys.executable, "-c", "pass"]) == 2
    assert capsys.readouterr().err == "error: --processes=0 must be >= 1\n"
    assert launch.main(["--elastic", "--", sys.executable, "-c", "pass"]) == 2
    assert capsys.readouterr().err == "error: --elastic and --hosts_file=FILE go together: the file says how many processes may run now\n"


def test_flag_values_are_checked_before_anything_runs(capsys, tmp_path):
    bench, pipeline = load("bench.py"), load("pipeline.py")
    assert bench.main(["mesh", "--mesh=dp8,ep9", "--override=zero_stage=1", f"--trees={tmp_path}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --mesh=ep9: not one of fsdp8, dp8, tp2dp4, tp2fsdp4, pp2dp4, cp2dp4, one",
    ]
    assert bench.main(["mesh", "--override=zero_stage=1", f"--trees={tmp_path}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --override=zero_stage=1: give SECTION.KEY=VALUE, e.g. parallel.zero_stage=1",
        f"error: --trees={tmp_path}: no scripts/bench.py there",
    ]
    assert bench.main(["moe", "--a2a_experts=8,x"]) == 2
    assert capsys.readouterr().err == "error: --a2a_experts=x: not a positive integer\n"
    assert pipeline.main(["report", "--schedules=1f1b,2f2b", "--stages=0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --schedules=2f2b: not one of {', '.join(pipeline.SCHEDULE_NAMES)}", "error: --stages=0 must be >= 1",
    ]
    profile = load("profile_report.py")
    os.makedirs(tmp_path / "empty")
    assert profile.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no *.xplane.pb under") and err.count("\n") == 1, err
