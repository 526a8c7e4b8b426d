"""The bad-input probe's harness, shared by its tables (tests/*/test_bad_*.py).

A case is a bad input run through a script's own `main(argv)` in this process: it must end with the
exit code the script's docstring promises for bad input (2), exactly one `error:` line on stderr
holding the words the case expects (the key, flag or file to change), no traceback, and nothing on
disk changed: no workdir or output created, every file the case wrote before the run byte-for-byte
as it was. The reference is that contract, as the developers' guide and the README state it, and the
facts the case planted itself (which line of which file is bad, which key holds which value).

`Probe` writes a case's inputs under a temporary root: a tiny config, record files, token files with
their sidecars, a tokenizer; `Probe.refused(script, argv, expected)` runs and checks one case.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil

import numpy as np

from tests.support.documents import texts
from tests.support.paths import ROOT

CONFIG_FILE = """
from tests.support import tiny
def get_config():
    c = tiny.llama(vocab_size=256)
    c.data.max_corpus_bytes = 100_000
    c.train.steps = 2
    return c
"""
MOE_CONFIG_FILE = """
from tests.support import tiny
def get_config():
    c = tiny.qwen3_moe(vocab_size=256)
    c.data.max_corpus_bytes = 100_000
    c.train.steps = 2
    return c
"""


@functools.cache
def script(name: str):
    """scripts/`name`.py as a module (its `main(argv)` runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"probe_{name}", os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snapshot(root) -> dict:
    """Every directory and file under `root`, files with their bytes."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            found[os.path.join(dirpath, d)] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                found[path] = f.read()
    return found


class Probe:
    def __init__(self, root, capsys, monkeypatch, tokenizer_dir=None):
        self.root, self.capsys, self.monkeypatch, self._tokenizer = root, capsys, monkeypatch, tokenizer_dir
        self.config = self.write("config.py", CONFIG_FILE)
        self.moe_config = self.write("moe_config.py", MOE_CONFIG_FILE)
        self.workdir = str(root / "run")  # never created by a refused run

    # -- inputs ---------------------------------------------------------------------------

    def path(self, name: str) -> str:
        path = self.root / name
        os.makedirs(path.parent, exist_ok=True)
        return str(path)

    def write(self, name: str, text) -> str:
        path = self.path(name)
        with open(path, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
        return path

    def records(self, name: str, count: int = 60, bad: dict | None = None, field: str = "text") -> str:
        """A jsonl file of `count` records; `bad` maps a 1-based line number to the raw bytes put there."""
        lines = [json.dumps({field: t}).encode() for t in texts(count, seed=3)]
        for number, raw in (bad or {}).items():
            lines[number - 1] = raw
        return self.write(name, b"\n".join(lines) + b"\n")

    def parquet(self, name: str, columns: dict) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.path(name)
        pq.write_table(pa.table(columns), path)
        return path

    def tokens(self, name: str, ids, dtype: str = "uint16", sidecar: dict | None = None, offsets=None) -> str:
        path = self.path(name)
        np.asarray(ids, dtype).tofile(path)
        if sidecar is not None:
            self.write(f"{name}.json", json.dumps({"dtype": dtype, "vocab_size": 256, "num_tokens": len(ids), **sidecar}))
        if offsets is not None:
            np.save(path + ".offsets.npy", np.asarray(offsets, np.int64))
        return path

    def tokenizer(self) -> str:
        """A copy of the module's tiny BPE tokenizer (vocab 120)."""
        target = self.root / "tokenizer"
        if not target.exists():
            shutil.copytree(self._tokenizer, target)
        return str(target)

    def train(self, *extra: str, config: str | None = None) -> list[str]:
        return [f"--config={config or self.config}", f"--workdir={self.workdir}", *extra]

    # -- the check ------------------------------------------------------------------------

    def refused(self, name: str, argv: list[str], expected: str, code: int = 2) -> str:
        """Runs scripts/`name`.py with `argv`; asserts the contract (module docstring); returns the line."""
        before = snapshot(self.root)
        self.capsys.readouterr()
        got = script(name).main(list(argv))
        out = self.capsys.readouterr()
        lines = [line for line in out.err.splitlines() if line.strip()]
        assert got == code, (got, out.err[-2000:], out.out[-2000:])
        assert "Traceback" not in out.err + out.out, out.err[-3000:]
        assert len(lines) == 1, lines
        assert lines[0].startswith("error: ") and expected in lines[0], (expected, lines[0])
        assert snapshot(self.root) == before, "a refused input changed files on disk"
        assert not os.path.exists(self.workdir)
        return lines[0]


def tokenizer_folder(tmp_path_factory) -> str:
    """A tiny BPE tokenizer (vocab 120), made once per module that asks for it (a module fixture's body)."""
    from tests.support.documents import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("probe_tokenizer") / "tokenizer")
