"""What a run prints before and during its steps: a line per start-up phase with its time, step
lines whose numbers read plainly (never `1.382e+04`), and a data banner that names each source.

No assertion bounds a time: the phase lines are checked by their form (`label ... N.N s`) and order,
numbers by parsing them back (the independent reading of what was printed).
"""

import io
import json
import re

import numpy as np
import pytest

from jaxpar.data.corpus import describe
from jaxpar.data.mixture import MixtureStream
from jaxpar.train.progress import Progress, StartupLog
from tests.support import tiny

PHASE = re.compile(r"^(?P<label>[^.:]+?)(?: \.\.\.|:) (?P<seconds>\d+\.\d) s$")


def test_step_lines_print_rates_as_plain_numbers(capsys):
    progress = Progress(total=2, start=0, log_every=1, tty=False)
    record = {"step": 1, "loss": 5.5646, "grad_norm": 12345.6, "learning_rate": 0.00015, "tokens_per_sec": 13820.4}
    progress.update(record)
    line = capsys.readouterr().out.strip()
    assert line == "step 1/2  loss 5.565  grad_norm 12,346  learning_rate 0.00015  tokens_per_sec 13,820"
    fields = dict(zip(line.split()[2::2], line.split()[3::2]))
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_sec"):  # read back, each is the record's value
        assert float(fields[key].replace(",", "")) == pytest.approx(record[key], rel=1e-3, abs=0.5), key
    assert "e+" not in line and "e-" not in line


def test_each_start_up_phase_is_one_line_with_its_time():
    out = io.StringIO()
    log = StartupLog(out=out)
    with log.phase("compiling the train step"):
        pass
    with log.phase("opening the data"):
        log.say("warning: a note said while the phase runs")
    with pytest.raises(RuntimeError), log.phase("initialising the parameters"):
        raise RuntimeError("the error ends the run; the phase's line is still finished")
    log.say("step 1/1")
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 and out.getvalue().endswith("\n"), lines
    assert PHASE.match(lines[0])["label"] == "compiling the train step" and lines[0].startswith("compiling the train step ... ")
    assert lines[1] == "opening the data ..." and lines[2] == "warning: a note said while the phase runs"
    assert PHASE.match(lines[3])["label"] == "opening the data" and lines[3].startswith("opening the data: ")
    assert PHASE.match(lines[4])["label"] == "initialising the parameters" and lines[5] == "step 1/1"
    closed = io.StringIO()  # a multi-process run: no line is left open for another thread's output to join
    with StartupLog(out=closed, open_lines=False).phase("compiling the train step"):
        print("[Gloo] Rank 0 is connected to 1 peer ranks", file=closed)
    lines = closed.getvalue().splitlines()
    assert lines[:2] == ["compiling the train step ...", "[Gloo] Rank 0 is connected to 1 peer ranks"]
    assert PHASE.match(lines[2])["label"] == "compiling the train step" and len(lines) == 3
    quiet = io.StringIO()
    with StartupLog(enabled=False, out=quiet).phase("on process 1"):
        pass
    assert quiet.getvalue() == ""


def test_the_data_banner_names_each_source_its_weight_and_tokenizer(tmp_path):
    config = tiny.llama(vocab_size=256)
    assert describe(config) == "data: the Python standard library's source (packed; bytes as tokens)"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    config.data.source, config.data.mixture = "datasets", f"{a}:3,{b}:1"
    lines = describe(config).splitlines()
    assert lines[0] == "data: a mixture of 2 sources, drawn document by document (packed; bytes as tokens):"
    probabilities = MixtureStream([iter(()), iter(())], [3, 1], seed=0).probabilities  # the mixture's own draw
    for line, path, weight, p in zip(lines[1:], (a, b), (3, 1), probabilities):
        assert line == f"  datasets {path}: weight {weight} ({p:.0%} of documents)"

    tokens = tmp_path / "t.bin"
    np.arange(100, dtype=np.uint16).tofile(tokens)
    config = tiny.llama(vocab_size=256)
    config.data.source, config.data.path = "tokens", str(tokens)
    assert describe(config) == f"data: tokens {tokens} (packed; ids of a tokenizer no sidecar names)"
    (tmp_path / "t.bin.json").write_text(json.dumps({"tokenizer": "/models/tok", "dtype": "uint16"}))
    assert describe(config) == f"data: tokens {tokens} (packed; tokenizer /models/tok, named by t.bin.json)"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_says_each_start_up_phase_before_its_first_step(tmp_path, capsys):
    import jax

    from jaxpar.train.loop import train

    config = tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 2}, data={"max_corpus_bytes": 100_000})
    config.train.steps = 1
    train(config, str(tmp_path / "run"), devices=jax.devices()[:2], progress=True)
    lines = capsys.readouterr().out.splitlines()
    phases = [m["label"] for m in map(PHASE.match, lines) if m]
    assert phases[:5] == [
        "checking the config, the data and the workdir", "building the model and its shardings",
        "compiling the train step and checking that it fits the devices' memory", "opening the data", "initialising the parameters",
    ], lines
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/1"))
    assert max(i for i, line in enumerate(lines) if PHASE.match(line)) < first_step
    assert "1 process, 2 devices; device -> mesh coordinates (axes of size 1 left out):" in lines
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "config.json", "goodput.json", "metrics.jsonl",
                                                                     "tensorboard"]
