"""Reading the project's markdown: its fenced code blocks and its tables, for the docs tests.

The documents are README.md, CONTRIBUTING.md and every docs/**/*.md. A fence's info string is a
language and then words (```` ```bash needs-hardware ````); a table is a run of lines starting with
`|` whose second line is the `|---|` separator. Both may be indented (inside a list item).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import REPO

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^`\s]*)\s*(.*?)\s*$")
_SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?$")


def documents(root: Path = REPO) -> list[Path]:
    """README.md, CONTRIBUTING.md and docs/**/*.md that exist, in a fixed order."""
    found = [root / name for name in ("README.md", "CONTRIBUTING.md")]
    found += sorted((root / "docs").rglob("*.md"))
    return [p for p in found if p.is_file()]


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    language: str
    words: tuple[str, ...]  # the info string after the language
    text: str

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(text: str, path: str = "<text>") -> list[Block]:
    """Every fenced code block of a markdown text."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language, rest = opening.groups()
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        found.append(Block(path, i + 1, language.lower(), tuple(rest.split()), "\n".join(body) + "\n"))
        i = j + 1
    return found


def outside_fences(text: str) -> str:
    """The text with every fenced block blanked (line numbers kept), so tables inside code are not read."""
    lines, inside, fence = text.splitlines(), False, ""
    out = []
    for line in lines:
        opening = _FENCE.match(line)
        if not inside and opening:
            inside, fence = True, opening.group(2)
            out.append("")
        elif inside and line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
            inside = False
            out.append("")
        else:
            out.append("" if inside else line)
    return "\n".join(out)


@dataclass(frozen=True)
class Table:
    path: str
    line: int  # 1-based line of the header row
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def cells(line: str) -> tuple[str, ...]:
    """The cells of one table row; `\\|` is a literal bar inside a cell."""
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1]
    return tuple(c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line))


def tables(text: str, path: str = "<text>") -> list[Table]:
    """Every markdown table outside code fences."""
    lines = outside_fences(text).splitlines()
    found, i = [], 0
    while i < len(lines) - 1:
        if lines[i].strip().startswith("|") and _SEPARATOR.match(lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and lines[j].strip().startswith("|"):
                j += 1
            found.append(Table(path, i + 1, cells(lines[i]), tuple(cells(line) for line in lines[i + 2 : j])))
            i = j
        else:
            i += 1
    return found


def cell_name(cell: str) -> str:
    """The name a cell starts with: the first code span if the cell opens with one, else its first word
    (emphasis, links and trailing punctuation removed). `\\`1f1b\\` (default)` -> `1f1b`."""
    cell = cell.strip().strip("*_").strip()
    link = re.match(r"^\[([^\]]*)\]\([^)]*\)", cell)
    if link:
        cell = link.group(1).strip()
    code = re.match(r"^`([^`]*)`", cell)
    if code:
        return code.group(1).strip()
    words = re.split(r"[\s(,;:]", cell, maxsplit=1)
    return words[0].strip("*_`.") if words else ""
