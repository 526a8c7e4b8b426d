"""scripts/pipeline.py, each subcommand on its smallest input, its printed numbers against theory:
bubbles against (p - 1) / (m + p - 1) (1F1B, GPipe) and (p - 1) / (v·m + p - 1) (interleaved), vocab
bytes per device against 1/p of the tables, stage splits against the layer count, tokens/s against
tokens over step time. `schedule` runs in process (no devices); the others in a child process that
emulates its own devices."""

import importlib.util
import math
import re

import pytest

from jaxpar.parallel.pipeline.schedules import SCHEDULE_NAMES
from tests.support.paths import REPO
from tests.support.rounding import assert_printed_quotient
from tests.support.scripts import numbers, run_script

spec = importlib.util.spec_from_file_location("pipeline_script", REPO / "scripts" / "pipeline.py")
pipeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pipeline)


def bubbles(out: str) -> tuple[float, float]:
    table = float(re.search(r"bubble \(table, lockstep costs\): ([\d.]+)", out).group(1))
    theory = float(re.search(r"bubble \(theory\): +([\d.]+)", out).group(1))
    return table, theory


@pytest.mark.parametrize("name, p, m, v, expected", [
    ("1f1b", 4, 8, 0, 3 / 11), ("gpipe", 2, 3, 0, 1 / 4), ("interleaved_1f1b", 4, 8, 2, 3 / 19),
])
def test_schedule_prints_the_textbook_bubble(name, p, m, v, expected, capsys):
    assert pipeline.main(["schedule", f"--schedule={name}", f"--stages={p}", f"--microbatches={m}", f"--virtual_stages={v}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{name}: p={p} m={m} v={max(v, 1)}")
    ranks = [line for line in out.splitlines() if re.match(r"r\d+ ", line)]
    assert len(ranks) == p
    table, theory = bubbles(out)
    assert table == pytest.approx(expected, abs=5e-5) and theory == pytest.approx(expected, abs=5e-5)
    # every microbatch's forward appears once per virtual stage on each rank
    assert sum(len(re.findall(r"F\d+", row)) for row in ranks) == m * p * max(v, 1)


def test_schedule_with_a_config_prints_its_split(capsys):
    assert pipeline.main(["schedule", "--stages=2", "--microbatches=3", f"--config={REPO / 'configs/llama_tiny.py'}"]) == 0
    split = re.search(r"stage layers \(spread vocab\): \[([\d, ]+)\]", capsys.readouterr().out).group(1)
    assert sum(int(n) for n in split.split(",")) == 4  # llama_tiny's layers
    assert pipeline.main(["schedule", "--stages=2", "--microbatches=3", f"--config={REPO / 'configs/llama_tiny.py'}",
                          "--stage_layers=3,3"]) == 2
    assert capsys.readouterr().err == "error: --stage_layers=3,3: sums to 6, not model.num_hidden_layers=4\n"
    assert pipeline.main(["schedule", "--schedule=dualpipev", "--stages=4", "--microbatches=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_memory_splits_the_vocab_tables_over_the_ranks():
    """llama_tiny (vocab 256, hidden 128, untied) on pipeline 2 x data 2: with the vocab spread, each
    rank holds half of the embedding and of the head; the layers and the final norm do not move."""
    done = run_script("pipeline.py", "memory", "--config=configs/llama_tiny.py", "--pipeline=2", "--devices=4", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = {line.split()[0]: numbers(line)[-1] for line in done.stdout.splitlines() if line.split()[:1] in
              (["embed"], ["lm_head"], ["final_norm"], ["layers"])}
    assert ratios == {"embed": 0.5, "lm_head": 0.5, "final_norm": 1.0, "layers": 1.0}, done.stdout
    vocab, hidden, p = 256, 128, 2
    expected = (2 * vocab * hidden / p + hidden) / (2 * vocab * hidden + hidden)  # both tables and the norm, + Adam alike
    line = next(line for line in done.stdout.splitlines() if line.startswith("vocab tables + Adam"))
    assert float(re.search(r"\(([\d.]+)×\)", line).group(1)) == pytest.approx(expected, abs=5e-4), line
    assert "'pipeline': 2" in done.stdout and "'data': 2" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_one_schedule():
    """1F1B alone at p = 2, m = 3 on a two-layer model without the no-pipeline baseline: the table's
    bubble, counted from the schedule's slots, and the theory column both equal (p - 1) / (m + p - 1) = 1/4."""
    p, m = 2, 3
    done = run_script(
        "pipeline.py", "report", f"--stages={p}", f"--microbatches={m}", "--data=1", "--layers=2", "--hidden=16",
        "--seq_len=8", "--microbatch_rows=1", "--steps=1", "--schedules=1f1b", "--baseline=false",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in {*SCHEDULE_NAMES, "no"}]
    assert [r[0] for r in rows] == ["1f1b"], out[-3000:]  # one schedule, no baseline row
    fields = ("schedule", "steps", "bubble", "theory", "stash", "buffers", "temp", "layers", "pp", "step_ms", "busy")
    assert len(rows[0]) == len(fields), rows[0]
    row = dict(zip(fields, rows[0]))
    bubble = (p - 1) / (m + p - 1)
    assert float(row["bubble"]) == pytest.approx(bubble, abs=5e-4), row  # counted from the slot table
    assert float(row["theory"]) == pytest.approx(bubble, abs=5e-4), row
    assert float(row["temp"]) > 0 and 0 < float(row["busy"]) < 1, row
    assert "1f1b: stage layers (spread vocab): [1, 1]" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_balance_moves_layers_off_the_rank_with_the_vocab():
    """4 layers, a vocab whose head costs several layers, p = 2: with the vocab at the ends, `auto`
    gives the last rank fewer layers than the equal split, and the ranks' modelled busy times move
    closer together; spread over the ranks, the equal split keeps both ranks equally busy. Tokens/s is
    the step's tokens over its measured time."""
    rows, m, seq = 1, 2, 16
    done = run_script(
        "pipeline.py", "balance", "--stages=2", f"--microbatches={m}", "--layers=4", "--vocab_size=4096", "--hidden=32",
        f"--seq_len={seq}", f"--microbatch_rows={rows}", "--steps=1", timeout=360,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = {}
    for line in done.stdout.splitlines():
        match = re.match(r"(ends|spread)\s+(equal = auto|ends' auto|equal|auto)\s+\[([\d, ]+)\]", line)
        if match:
            values = numbers(line[match.end():])  # busy per rank (2), FLOP model, timed model ms, step ms, tok/s
            table[match.group(1), match.group(2)] = ([int(n) for n in match.group(3).split(",")], values)
    assert set(table) == {("ends", "equal"), ("ends", "auto"), ("spread", "equal = auto"), ("spread", "ends' auto")}, done.stdout
    (equal, eq), (auto, au) = table["ends", "equal"], table["ends", "auto"]
    assert equal == [2, 2] and sum(auto) == 4 and auto[-1] < auto[0], table
    assert eq[2] == 1.0, table  # the FLOP model's step, in units of (ends, equal)
    assert eq[1] > eq[0] and abs(au[1] - au[0]) < abs(eq[1] - eq[0]), table  # busy per rank: the head's rank idles less
    for _, values in table.values():
        step_ms, tokens_per_s = values[-2], values[-1]
        assert_printed_quotient(tokens_per_s, rows * m * seq * 1e3, step_ms, decimals=0, denominator_decimals=1, context=values)
    busy = table["spread", "equal = auto"][1][:2]
    assert math.isclose(busy[0], busy[1], abs_tol=0.011), table
