"""Smoke tests for the report scripts no other test runs: each on its smallest input (one tiny
layout, one step), checking that it exits 0 and prints or writes what its docstring promises.
Their numbers are checked elsewhere (the planner and cost model in tests/analysis/test_analysis.py and
tests/analysis/test_planner.py, schedules in tests/parallel/pipeline/test_schedules.py); here only that the scripts still
run against the library as it is now. (`pipeline_report.py` runs one schedule, `--schedules=1f1b`,
on a two-layer model: its bubble column is checked against (p - 1) / (m + p - 1).)

Each runs in its own process (absl flags are process-global) with the suite's fast-compile XLA flags
but not its device count: the scripts set their own.
"""

import csv
import os
import subprocess
import sys

import pytest

from jaxpar.parallel.pipeline.schedules import SCHEDULE_NAMES
from tests.support.compile_flags import subprocess_environment
from tests.support.paths import ROOT


def env():
    return subprocess_environment(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


def script(name: str, *args, code: str | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, os.path.join(ROOT, "scripts", name), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env(), timeout=timeout, cwd=ROOT)


def test_plan_script_ranks_the_layouts_of_a_tiny_config():
    done = script("plan.py", "--config=configs/llama_tiny.py", "--hardware=a100-80g", "--devices=4", "--top=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan for 4 x a100-80g:" in done.stdout and "Binding vertex" in done.stdout, done.stdout[-3000:]
    bad = script("plan.py", "--config=configs/llama_tiny.py", "--hardware=b200x", "--devices=4")
    assert bad.returncode != 0 and "--hardware: unknown hardware 'b200x'" in bad.stderr, bad.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sweep_script_compiles_one_layout(tmp_path):
    out = tmp_path / "sweep"
    done = script(
        "sweep.py", "--config=configs/llama_tiny.py", "--devices=2", f"--out={out}", "--limit=1", "--zero_stages=0",
        "--plots=false",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "sweep.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row, "one compiled layout, one row"
    assert "1 layouts in" in done.stdout and (out / "sweep.md").read_text().startswith("#")


# bench.py times the shared bench config (8 layers, hidden 512, vocab 8192: 58 CPU-seconds for one
# step and its profile here); the smoke test swaps in the tiny model and keeps the rest of the script.
BENCH = """
import sys, importlib.util
from tests.support import tiny
spec = importlib.util.spec_from_file_location("bench", "scripts/bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
bench.load_config = lambda model: tiny.with_overrides(tiny.llama(vocab_size=256), {})
from absl import app
sys.argv = ["bench.py", *sys.argv[1:]]
app.run(bench.main)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_one_step_and_profile_report_read_its_trace(tmp_path):
    profile = tmp_path / "profile"
    done = script("bench.py", "--steps=1", f"--profile={profile}", code=BENCH)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("step_s=") and "tokens_per_sec=" in last and "gflops_per_sec=" in last, last
    report = script("profile_report.py", str(profile), "--top=1")
    assert report.returncode == 0, report.stderr[-3000:]
    assert "layer_scan" in report.stdout and "collectives (all)" in report.stdout, report.stdout[-3000:]
    (tmp_path / "empty").mkdir()
    empty = script("profile_report.py", str(tmp_path / "empty"))
    assert empty.returncode == 1 and "no *.xplane.pb under" in empty.stderr, empty.stderr[-3000:]


BENCH_PACKING = BENCH.replace("bench.py", "bench_packing.py").replace('"bench"', '"bench_packing"')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_packing_one_step_each():
    done = script("bench_packing.py", "--steps=1", "--repeats=1", "--attention=jaxpar_xla", code=BENCH_PACKING)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-2].startswith("attention=jaxpar_xla wall unpacked_ms=") and "short / unpacked = " in lines[-1], lines
    assert "segments a row" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_context_report_small(tmp_path):
    done = script(
        "context_report.py", "--seq_lens=32", "--contexts=1,2", "--impls=ring", "--layers=1", "--hidden=32", "--heads=2",
        "--kv_heads=1", "--block=16", f"--out={tmp_path / 'context.png'}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ring" in done.stdout and (tmp_path / "context.png").stat().st_size > 0, done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_report_one_schedule():
    """1F1B alone at p = 2, m = 3 on a two-layer model without the no-pipeline baseline: the table's
    bubble, counted from the schedule's slots, and the theory column both equal (p - 1) / (m + p - 1) = 1/4."""
    p, m = 2, 3
    done = script(
        "pipeline_report.py", f"--stages={p}", f"--microbatches={m}", "--data=1", "--layers=2", "--hidden=16",
        "--seq_len=8", "--microbatch_rows=1", "--steps=1", "--schedules=1f1b", "--baseline=false",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "schedule" in out and "bubble" in out and "theory" in out, out[-3000:]
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
