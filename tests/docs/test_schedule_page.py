"""docs/pipeline_schedules.md's summary table holds the records' own numbers (issue 34 item 2).

Every figure of its table (virtual stages, backward, textbook and measured bubble at p = 4, m = 8,
time units, peak stash per rank) is recomputed here from the schedule records and the tables they
build, and every schedule has its section and its drawn table on the page. A number typed by hand that
a schedule change made stale fails, as a planted one shows.
"""

from __future__ import annotations

import re

from jaxpar.parallel.pipeline.checks import peak_in_flight
from jaxpar.parallel.pipeline.schedules import SCHEDULES
from jaxpar.parallel.pipeline.table import bubble_fraction, step_costs
from tests.support.markdown import cell_name, tables
from tests.support.paths import REPO

PAGE = REPO / "docs" / "pipeline_schedules.md"
P, M = 4, 8


def expected_row(kind) -> dict[str, str]:
    """What the page's row for a record must say, from the record and its table."""
    v = kind.default_virtual_stages
    table = kind.table(P, M, v)
    takes = f"any v (here {v})" if kind.virtual_stages is None else " or ".join(map(str, kind.virtual_stages))
    return {
        "virtual stages": takes,
        "backward": "B and W" if kind.split_backward else "whole",
        f"bubble at p = {P}, m = {M} (textbook)": f"{kind.bubble(P, M, v):.3f}",
        f"bubble at p = {P}, m = {M} (its table)": f"{bubble_fraction(table):.3f}",
        "time units": str(int(step_costs(table).sum())),
        "peak stash per rank": ", ".join(map(str, peak_in_flight(table))),
    }


def page_problems(text: str) -> list[str]:
    summary = next((t for t in tables(text, "pipeline_schedules.md") if t.header[:1] == ("schedule",)), None)
    if summary is None:
        return ["no summary table whose first column is `schedule`"]
    rows = {cell_name(row[0]): dict(zip(summary.header, row)) for row in summary.rows}
    problems = []
    for kind in SCHEDULES:
        if kind.name not in rows:
            problems.append(f"{kind.name}: no row")
            continue
        for column, value in expected_row(kind).items():
            if rows[kind.name].get(column) != value:
                problems.append(f"{kind.name}: {column} is {rows[kind.name].get(column)!r}, the record gives {value!r}")
        if f"\n## {kind.name}\n" not in text or f"(figures/schedules/{kind.name}.png)" not in text:
            problems.append(f"{kind.name}: no section with its drawn table (figures/schedules/{kind.name}.png)")
        elif not (PAGE.parent / "figures" / "schedules" / f"{kind.name}.png").is_file():
            problems.append(f"{kind.name}: docs/figures/schedules/{kind.name}.png is missing (python scripts/docs.py figures)")
    return problems


def test_the_summary_table_is_what_the_records_give():
    assert page_problems(PAGE.read_text()) == []


def test_a_stale_number_and_a_missing_section_are_found():
    text = PAGE.read_text()
    stale = re.sub(r"(\| `zb_h1` \|.*?\| )0\.111( \|)", r"\g<1>0.100\2", text, count=1)
    assert stale != text
    found = page_problems(stale)
    assert len(found) == 1 and "zb_h1" in found[0] and "0.100" in found[0], found
    no_section = text.replace("\n## dualpipev\n", "\n## dualpipe v\n")
    assert any("dualpipev: no section" in p for p in page_problems(no_section))
