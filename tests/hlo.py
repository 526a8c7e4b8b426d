"""Reading collectives out of compiled HLO text: which op, result shapes, and loop depth."""

from __future__ import annotations

import re
from dataclasses import dataclass

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    op: str
    shapes: tuple  # result shapes (tuples of ints); several for a combined op
    loop_depth: int  # 0: runs once per step; ≥1: inside that many nested while loops


def _shapes(result_type: str) -> tuple:
    result_type = re.sub(r"/\*index=\d+\*/", "", result_type)
    return tuple(
        tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", result_type)
    )


def collectives(hlo_text: str) -> list[Collective]:
    computation, callers, found = None, {}, []
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
            continue
        for kind, callee in re.findall(r"(body|calls|condition|to_apply)=%([\w.\-]+)", line):
            callers[callee] = (computation, kind == "body")
        op = re.search(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line)
        if op:
            found.append((computation, op.group(2), _shapes(op.group(1))))

    def depth(name):
        d, seen = 0, 0
        while name in callers and seen < 50:
            name, is_body = callers[name]
            d += is_body
            seen += 1
        return d

    return [Collective(op, shapes, depth(comp)) for comp, op, shapes in found]
