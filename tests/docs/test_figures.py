"""The pictures the docs ship are readable where a page shows them, and the scripts that draw them
answer bad input in one line (issue 34 item 11, "Pictures").

- Every PNG the docs embed exists and is at most `MAX_WIDTH` pixels wide: a page scales wider images
  down until their labels cannot be read (the sweep plots were 3,190-5,520 px wide, ~100 bars).
- `replot_sweep` redraws a shipped sweep from its CSV alone, within that width.
- `scripts/plot_run.py` draws a run's curve, and refuses a folder without metrics in one line, exit 2.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys

import pytest

from tests.support.markdown import documents, outside_fences
from tests.support.paths import REPO

MAX_WIDTH = 1920  # px; what a screen shows at full size (the shipped pictures are 830-1600, one 1815)
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    return struct.unpack(">II", data[16:24])


def embedded_images() -> list:
    found = set()
    for page in documents():
        for link in _IMAGE.findall(outside_fences(page.read_text())):
            if not re.match(r"^[a-z]+:", link):
                found.add((page.parent / link).resolve())
    return sorted(found)


def too_wide(paths) -> list[str]:
    problems = []
    for path in paths:
        width, _ = png_size(path.read_bytes())
        if width > MAX_WIDTH:
            shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
            problems.append(f"{shown}: {width} px wide (at most {MAX_WIDTH})")
    return problems


def test_the_docs_embed_pictures():
    names = {p.name for p in embedded_images()}
    assert {"mesh.png", "quickstart_loss.png", "1f1b.png", "memory.png", "step_time.png"} <= names, names


def test_every_embedded_picture_is_readable_at_page_width():
    assert too_wide(embedded_images()) == []


def test_a_wide_picture_is_found(tmp_path):
    """Positive control: a PNG as wide as the old sweep plots (its header is all the check reads)."""
    wide = tmp_path / "wide.png"
    wide.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + struct.pack(">II", 5520, 660) + b"\x08\x06\x00\x00\x00")
    assert too_wide([wide]) == [f"wide.png: 5520 px wide (at most {MAX_WIDTH})"]


def test_a_sweep_is_redrawn_from_its_csv_within_the_width(tmp_path):
    from jaxpar.analysis.reports.plots import replot_sweep

    sweep = tmp_path / "mixtral"
    sweep.mkdir()
    for name in ("sweep.csv", "sweep.md"):
        shutil.copy(REPO / "docs" / "sweeps" / "mixtral_8x7b_8dev" / name, sweep / name)
    paths = replot_sweep(str(sweep))
    for path in paths:
        width, height = png_size(open(path, "rb").read())
        assert 800 <= width <= 1600 and height <= 1200, (path, width, height)


def _run(*argv, cwd=REPO):
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_plot_run_draws_a_run_and_refuses_a_folder_without_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": i, "loss": 5.0 / i, "learning_rate": 1e-3 * i} for i in range(1, 21)]
    records.insert(10, {"step": 10, "eval_loss": 0.6, "eval_perplexity": 1.8, "eval_tokens": 128})
    (run / "metrics.jsonl").write_text("".join(f"{r}\n".replace("'", '"') for r in records))
    result = _run("scripts/plot_run.py", str(run), f"--out={tmp_path / 'loss.png'}")
    assert result.returncode == 0, result.stderr
    assert png_size((tmp_path / "loss.png").read_bytes())[0] <= MAX_WIDTH
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _run("scripts/plot_run.py", str(empty), f"--out={tmp_path / 'never.png'}")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "metrics.jsonl" in refused.stderr, refused
    assert not (tmp_path / "never.png").exists()


@pytest.mark.parametrize("argv", [["figures", "--run=no/such/run"], ["config", "--no_such_flag"]])
def test_docs_script_refuses_bad_input_in_one_line(argv):
    result = _run("scripts/docs.py", *argv)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result
