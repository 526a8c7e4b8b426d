"""The report scripts no other test runs, each on its smallest input (one tiny layout, one step),
checking what its docstring promises. The numbers behind them are checked elsewhere (the planner and
cost model in tests/analysis/, schedules in tests/parallel/pipeline/); here that the scripts run
against the library as it is now, and that what they print agrees with theory where it can:
experiments.py's bubble cells against (p - 1) / (m + p - 1). scripts/bench.py and scripts/pipeline.py
have their own files beside this one.
"""

import csv
import re

import pytest

from tests.support.scripts import run_script


def test_plan_script_ranks_the_layouts_of_a_tiny_config():
    done = run_script("plan.py", "--config=configs/llama_tiny.py", "--hardware=a100-80g", "--devices=4", "--top=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan for 4 x a100-80g:" in done.stdout and "What limits the" in done.stdout and "The config's own layout" in done.stdout, \
        done.stdout[-3000:]
    bad = run_script("plan.py", "--config=configs/llama_tiny.py", "--hardware=b200x", "--devices=4")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --hardware: unknown hardware 'b200x'"), bad.stderr[-3000:]
    bad = run_script("plan.py", "--config=configs/llama_tiny.py", "--compare=tensor=x", "--efficiency=fast")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "error: --compare: 'tensor=x' is not AXIS=SIZE with AXIS one of data, pipeline, context, expert, tensor and SIZE >= 1",
        "error: --efficiency='fast' is neither 'achieved' nor a number",
    ], bad.stderr


def test_experiments_pipeline_section_has_the_textbook_bubbles(tmp_path):
    """The cheapest section (schedule tables, nothing compiled): every GPipe and 1F1B cell's table bubble and
    textbook bubble are (p - 1) / (m + p - 1), interleaved 1F1B's (p - 1) / (2m + p - 1); the page cites the
    source article by its title."""
    out = tmp_path / "experiments.md"
    done = run_script("experiments.py", "--sections=pipeline", f"--out={out}", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert re.findall(r"Source: (.*)", text) == ['the article "这不是“背概念”，而是搞懂大模型训练时GPU到底在忙什么".'], text[:600]
    checked = 0
    for p, block in re.findall(r"p = (\d+) ranks\..*?\n\n(\|.*?)\n\n", text, re.S):
        p = int(p)
        for row in block.splitlines()[2:]:
            cells = [c.strip() for c in row.strip("|").split("|")]
            m = int(cells[0])
            for column, v in ((1, 1), (2, 1), (3, 2)):  # GPipe, 1F1B, interleaved 1F1B (v = 2)
                table, textbook = (float(x) for x in re.findall(r"([\d.]+)%", cells[column]))
                expected = 100 * (p - 1) / (v * m + p - 1)
                assert table == pytest.approx(expected, abs=0.05) and textbook == pytest.approx(expected, abs=0.05), (p, m, cells)
                checked += 1
    assert checked == 3 * 10, checked  # 5 microbatch counts for each of p = 4 and 8


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sweep_script_compiles_one_layout(tmp_path):
    out = tmp_path / "sweep"
    done = run_script(
        "sweep.py", "--config=configs/llama_tiny.py", "--devices=2", f"--out={out}", "--limit=1", "--zero_stages=0",
        "--plots=false",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "sweep.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row, "one compiled layout, one row"
    assert "1 layouts in" in done.stdout and (out / "sweep.md").read_text().startswith("# llama_tiny.py on 2 devices")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_context_report_small(tmp_path):
    done = run_script(
        "context_report.py", "--seq_lens=32", "--contexts=1,2", "--impls=ring", "--layers=1", "--hidden=32", "--heads=2",
        "--kv_heads=1", "--block=16", f"--out={tmp_path / 'context.png'}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ring" in done.stdout and (tmp_path / "context.png").stat().st_size > 0, done.stdout[-3000:]
