"""scripts/fp8.py: bad input is one line on stderr naming the flag, exit 2, before anything runs.
(Its runs: the docs' commands, shrunk, in the slow tier: `tests/docs/test_commands.py`.)"""

import importlib.util

import pytest

from tests.support.paths import REPO


def _main():
    spec = importlib.util.spec_from_file_location("fp8_script", REPO / "scripts" / "fp8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("argv, named", [
    (["curves", "--train_config=configs/no_such.py"], "--train_config=configs/no_such.py is not a file"),
    (["curves", "--steps=0"], "--steps=0 must be >= 1"),
    (["curves", "--out=/no/such/folder/x.png"], "--out=/no/such/folder/x.png: the folder"),
    (["step", "--repeats=0"], "--repeats=0 must be >= 1"),
])
def test_bad_flags_one_line_exit_2(argv, named, capsys):
    assert _main()(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
