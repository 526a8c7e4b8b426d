"""Tables in the docs that list records list exactly the records (issue 34 item 3).

A markdown table in README.md, CONTRIBUTING.md or docs/**/*.md "lists" a kind of record when at
least two of its row names (the first cell of each row) — or of its column names (the header
after its first cell) — are names of records of that kind. Such a table must then name every record of the kind and
nothing else: a table that lists four of the six pipeline schedules fails, and so does one that
names a schedule that no longer exists. The names come from jaxpar itself, never typed here:

- pipeline schedules: `jaxpar.parallel.pipeline.schedules.SCHEDULES`
- model families: `jaxpar.models.families.FAMILIES`
- optimizers: `jaxpar.optim.OPTIMIZERS`; learning-rate schedules: `jaxpar.optim.SCHEDULES`
- attention kernels: `jaxpar.parallel.plan.ATTENTION_IMPLS` (`auto`, a choice among the kernels,
  may be left out of a table of kernels)
- context-parallel implementations: `jaxpar.parallel.context.sharded.IMPLS`

A row's name is the cell's first code span, else its first word (`` `1f1b` (default) `` is `1f1b`).
docs/config.md is generated from the records and is checked here like every other page.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jaxpar.models.families import FAMILIES
from jaxpar.optim import OPTIMIZERS
from jaxpar.optim import SCHEDULES as LR_SCHEDULES
from jaxpar.parallel.context.sharded import IMPLS as CONTEXT_IMPLS
from jaxpar.parallel.pipeline.schedules import SCHEDULES as PIPELINE_SCHEDULES
from jaxpar.parallel.plan import ATTENTION_IMPLS
from tests.support.markdown import Table, cell_name, documents, tables
from tests.support.paths import REPO


@dataclass(frozen=True)
class Kind:
    name: str
    names: frozenset
    optional: frozenset = frozenset()  # names a table may leave out


KINDS = (
    Kind("pipeline schedules", frozenset(k.name for k in PIPELINE_SCHEDULES)),
    Kind("model families", frozenset(FAMILIES)),
    Kind("optimizers", frozenset(o.name for o in OPTIMIZERS)),
    Kind("learning-rate schedules", frozenset(s.name for s in LR_SCHEDULES)),
    Kind("attention kernels", frozenset(ATTENTION_IMPLS), optional=frozenset({"auto"})),
    Kind("context-parallel implementations", frozenset(CONTEXT_IMPLS)),
)


def _problems_of(table: Table, names: list[str], where: str) -> list[str]:
    problems = []
    for kind in KINDS:
        if len(set(names) & kind.names) < 2:
            continue
        missing = sorted(kind.names - kind.optional - set(names))
        unknown = sorted(set(names) - kind.names)
        if missing:
            problems.append(f"{table.name}: its {where} list {kind.name} but leave out {', '.join(missing)}")
        if unknown:
            problems.append(
                f"{table.name}: its {where} list {kind.name} but also name {', '.join(unknown)}, which is not one "
                f"(the records: {', '.join(sorted(kind.names))})"
            )
    return problems


def table_problems(table: Table) -> list[str]:
    """One line per way this table differs from the records it lists (empty: it lists none, or exactly them)."""
    rows = [cell_name(row[0]) for row in table.rows if row and row[0].strip()]
    header = [cell_name(cell) for cell in table.header[1:] if cell.strip()]  # the first names the rows
    return _problems_of(table, rows, "rows") + _problems_of(table, header, "columns")


def document_problems(text: str, path: str) -> list[str]:
    return [p for table in tables(text, path) for p in table_problems(table)]


def _schedules_table(names) -> str:
    rows = "\n".join(f"| `{n}` | a schedule |" for n in names)
    return f"Some text.\n\n| schedule | what |\n|---|---|\n{rows}\n\nMore text.\n"


def test_a_planted_table_of_four_schedules_fails():
    """Positive control: the README's old config row (four of six schedules) as a table is caught."""
    planted = _schedules_table(["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"])
    problems = document_problems(planted, "planted.md")
    assert len(problems) == 1 and "dualpipev" in problems[0] and "zb_v" in problems[0], problems


def test_a_planted_table_naming_a_missing_record_fails():
    names = [k.name for k in PIPELINE_SCHEDULES] + ["zb_x"]
    problems = document_problems(_schedules_table(names), "planted.md")
    assert len(problems) == 1 and "zb_x" in problems[0], problems


def test_a_table_of_every_record_passes_and_other_tables_are_not_read_as_lists():
    assert document_problems(_schedules_table([k.name for k in PIPELINE_SCHEDULES]), "planted.md") == []
    # Columns are read too; one name alone is no list; fenced tables are code, not tables.
    columns = "| m | " + " | ".join(f"`{o.name}`" for o in OPTIMIZERS[:3]) + " |\n|---|---|---|---|\n| 1 | a | b | c |\n"
    assert len(document_problems(columns, "planted.md")) == 1
    config_rows = "| key | default |\n|---|---|\n| `parallel.pipeline_schedule` | `1f1b` |\n| `train.optimizer` | `adamw` |\n"
    assert document_problems(config_rows, "planted.md") == []
    fenced = "```text\n" + _schedules_table(["gpipe", "1f1b"]) + "```\n"
    assert document_problems(fenced, "planted.md") == []
    kernels = "| impl | |\n|---|---|\n" + "".join(f"| `{n}` | |\n" for n in ATTENTION_IMPLS if n != "auto")
    assert document_problems(kernels, "planted.md") == []


def test_every_kind_has_records():
    """The lists come from the records: an empty one would make every check above vacuous."""
    assert all(len(kind.names) >= 2 for kind in KINDS), [k.name for k in KINDS if len(k.names) < 2]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_tables_list_exactly_the_records(path):
    assert document_problems(path.read_text(), str(path.relative_to(REPO))) == []
