"""The command line every script shares (`jaxpar.command`): flags, subcommands, config overrides,
one `error:` line per problem and exit code 2."""

import pytest

from jaxpar.command import Command, Flag, main
from jaxpar.command.flags import parse
from tests.support.paths import ROOT

FLAGS = (
    Flag("steps", int, 4, "", at_least=1),
    Flag("rate", float, 0.5),
    Flag("fast", bool, False),
    Flag("mesh", list, "dp8,tp2dp4", choices=("dp8", "tp2dp4", "pp2dp4")),
    Flag("prompt", str, repeat=True),
    Flag("where", str, positional=True),
)


def test_every_spelling_of_a_flag():
    args, overrides, problems = parse(
        ["--steps=7", "--rate", "0.25", "--fast", "--mesh=pp2dp4", "--prompt=a", "--prompt", "b c", "runs/x"], FLAGS
    )
    assert problems == [] and overrides == []
    assert (args.steps, args.rate, args.fast, args.mesh, args.prompt, args.where) == (7, 0.25, True, ["pp2dp4"], ["a", "b c"], "runs/x")
    defaults, _, _ = parse([], FLAGS)
    assert (defaults.steps, defaults.fast, defaults.mesh, defaults.prompt, defaults.where) == (4, False, ["dp8", "tp2dp4"], [], None)
    assert parse(["--fast", "--nofast"], FLAGS)[0].fast is False
    assert parse(["--fast=false"], FLAGS)[0].fast is False


def test_every_problem_is_one_line_naming_the_flag():
    _, _, problems = parse(["--stpes=3", "--steps=0", "--rate=x", "--mesh=dp8,ep9", "--fast=maybe", "a", "b"], FLAGS)
    assert problems == [
        "unknown flag --stpes; did you mean --steps?",
        "--steps=0 must be >= 1",
        "--rate='x' must be a number",
        "--mesh=ep9: not one of dp8, tp2dp4, pp2dp4",
        "--fast='maybe' must be true or false",
        "unexpected argument 'b'; flags look like --name=value",
    ]


def _commands(seen):
    def record(name):
        def run(args, config):
            seen.append((name, args, config))
            return 0 if name == "report" else 5

        return run

    return (
        Command("report", "time it", record("report"), flags=(Flag("stages", int, 4),)),
        Command("draw", "draw it", record("draw"), config="optional",
                checks=lambda a: [] if a.config else ["--config is needed to draw"]),
    )


def test_subcommands_dispatch_and_exit_codes(capsys):
    seen = []
    assert main("doc", _commands(seen), ["report", "--stages=2"]) == 0
    assert seen[-1][0] == "report" and seen[-1][1].stages == 2 and seen[-1][2] is None
    assert main("doc", _commands(seen), ["draw", f"--config={ROOT}/configs/llama_tiny.py", "--config.train.steps=3"]) == 5
    name, args, config = seen[-1]
    assert name == "draw" and config.train.steps == 3 and args.overrides == [("train.steps", "3")]
    assert main("doc", _commands(seen), ["--help"]) == 0 and "report  time it" in capsys.readouterr().out
    before = len(seen)
    assert main("doc", _commands(seen), ["plot"]) == 2
    assert capsys.readouterr().err == "error: unknown command 'plot'; one of report, draw\n"
    assert main("doc", _commands(seen), ["report", "--config.train.steps=3", "--stages=x"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --stages='x' must be an integer", "error: --config.train.steps: this command takes no config"
    ]
    assert main("doc", _commands(seen), ["draw", f"--config={ROOT}/configs/llama_tiny.py", "--config.train.stpes=3"]) == 2
    assert "did you mean --config.train.steps?" in capsys.readouterr().err
    assert main("doc", _commands(seen), ["draw"]) == 2 and capsys.readouterr().err == "error: --config is needed to draw\n"
    assert len(seen) == before  # nothing ran on bad input


@pytest.mark.parametrize("argv", [["--x"], ["a", "b"]])
def test_a_single_command_script_takes_no_command_word(argv, capsys):
    ran = []
    only = (Command(None, "one", lambda args, config: ran.append(args), flags=(Flag("where", str, positional=True),)),)
    assert main("doc", only, argv) == 2 and not ran
    assert len(capsys.readouterr().err.splitlines()) == 1
