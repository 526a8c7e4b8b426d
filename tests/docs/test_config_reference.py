"""docs/config.md is what `python scripts/docs.py config` writes (issue 34 item 3): generated from the
schema and the records (`jaxpar.reference`), so it cannot fall behind them.

Also checked independently of the generator: every key of the schema, read by walking
`base_config()` and each family's schema here (`flat_keys`, the docs' own reader), is in the
reference with its default; and the generator refuses a key without a meaning, or a meaning
without a key, each shown on a planted case.
"""

from __future__ import annotations

import re

import pytest
from ml_collections import ConfigDict

from jaxpar import config as schema
from jaxpar import reference
from jaxpar.models import schema as model_schema
from jaxpar.models.families import FAMILIES
from tests.support.doc_commands import flat_keys
from tests.support.paths import REPO

PAGE = REPO / reference.PATH
_ROW = re.compile(r"^\| `([\w.]+)` \| (`(?:[^`])*`) \|", flags=re.M)  # | `key` | `default` | ...


def first_difference(expected: str, actual: str) -> str | None:
    """None when equal; else one line naming the first line that differs and how to fix it."""
    if expected == actual:
        return None
    want, have = expected.splitlines(), actual.splitlines()
    for number, (a, b) in enumerate(zip(want, have), 1):
        if a != b:
            return f"{reference.PATH}:{number} differs: {b!r}, the generator writes {a!r}; run python scripts/docs.py config"
    return f"{reference.PATH} has {len(have)} lines, the generator writes {len(want)}; run python scripts/docs.py config"


def test_config_md_is_what_the_generator_writes():
    assert first_difference(reference.render(), PAGE.read_text()) is None


def test_a_stale_reference_is_found():
    """Positive control: the page as it would be with one default changed by hand, or one key gone."""
    text = reference.render()
    stale = text.replace("| `train.steps` | `100` |", "| `train.steps` | `200` |")
    assert stale != text
    assert "config.md:" in first_difference(text, stale) and "`200`" in first_difference(text, stale)
    shorter = "\n".join(line for line in text.splitlines() if "`train.seed`" not in line) + "\n"
    assert first_difference(text, shorter) is not None


def _schema_leaves() -> dict[str, object]:
    """Every leaf key of the schema with its default, read here without the generator."""
    config = schema.base_config()
    found = {}
    for key in sorted(flat_keys(config)):
        value = config
        for part in key.split("."):
            value = value[part]
        if not isinstance(value, ConfigDict):
            found[key] = value
    return found


def test_every_schema_key_is_in_the_reference_with_its_default():
    text = PAGE.read_text()
    rows = {}
    for key, default in _ROW.findall(text):  # the first row of a key: the section's (families' come later)
        rows.setdefault(key, default)
    leaves = _schema_leaves()
    assert len(leaves) > 60, len(leaves)
    missing = sorted(k for k in leaves if k not in rows)
    assert not missing, missing
    wrong = {k: (rows[k], v) for k, v in leaves.items() if rows[k] != reference.value_text(v)}
    assert not wrong, wrong
    shared = {k[len("model."):]: v for k, v in leaves.items() if k.startswith("model.")}
    for family in FAMILIES.values():  # each family's table: its keys whose default is not the shared one
        section = text.split(f"\n### {family.name}\n", 1)[1].split("\n#", 1)[0]
        listed = dict(_ROW.findall(section))
        model = family.schema()
        for key in flat_keys(model):
            value = model
            for part in key.split("."):
                value = value[part]
            if isinstance(value, ConfigDict) or key == "model_type" or (key in shared and shared[key] == value):
                continue
            assert listed.get(f"model.{key}") == reference.value_text(value), (family.name, key, value)


def test_a_key_without_a_meaning_is_refused(monkeypatch):
    base = schema.base_config

    def with_a_new_key():
        config = base()
        config.parallel.planted_option = 3
        return config

    monkeypatch.setattr(schema, "base_config", with_a_new_key)
    with pytest.raises(reference.ReferenceError, match="parallel.planted_option has no meaning"):
        reference.render()


def test_a_meaning_without_a_key_is_refused(monkeypatch):
    monkeypatch.setitem(schema.MEANINGS, "train.removed_key", "a key the schema no longer has")
    with pytest.raises(reference.ReferenceError, match="train.removed_key"):
        reference.render()
    monkeypatch.setitem(model_schema.MEANINGS, "planted_model_key", "a model key no family has")
    monkeypatch.delitem(schema.MEANINGS, "train.removed_key")
    with pytest.raises(reference.ReferenceError, match="planted_model_key"):
        reference.render()
