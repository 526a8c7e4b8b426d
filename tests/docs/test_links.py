"""Links between the docs lead somewhere: every relative link of README.md, CONTRIBUTING.md and
docs/**/*.md names a file of the repository, and a `#fragment` into a markdown page names one of its
headings (GitHub's anchor rule: lower case, punctuation dropped, spaces as hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.markdown import documents, outside_fences
from tests.support.paths import REPO

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    found = set()
    for line in outside_fences(text).splitlines():
        if line.startswith("#"):
            title = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            found.add(title.replace(" ", "-"))
    return found


def broken_links(path: Path, text: str) -> list[str]:
    problems = []
    for match in _LINK.finditer(outside_fences(text)):
        link = match.group(1)
        if re.match(r"^[a-z]+:", link):  # https:, mailto:
            continue
        target, _, fragment = link.partition("#")
        file = (path.parent / target).resolve() if target else path.resolve()
        if not file.exists():
            problems.append(f"{path.name}: {link}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            problems.append(f"{path.name}: {link}: no heading #{fragment} in {file.name}")
    return problems


def test_a_planted_broken_link_and_anchor_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Exit codes\n\n[ok](#exit-codes) [gone](missing.md) [bad](#no-such) [web](https://x.org)\n")
    assert broken_links(page, page.read_text()) == [
        "page.md: missing.md: no such file", "page.md: #no-such: no heading #no-such in page.md",
    ]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_lead_somewhere(path):
    assert broken_links(path, path.read_text()) == []
