"""Reading collectives out of compiled HLO text: which op, result shapes, loop depth, and whether
it sits inside a conditional's branch (read from the HLO's `branch_computations` /
`true_computation` / `false_computation`, not from op-name metadata)."""

from __future__ import annotations

import re
from dataclasses import dataclass

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    op: str
    shapes: tuple  # result shapes (tuples of ints); several for a combined op
    loop_depth: int  # 0: runs once per step; ≥1: inside that many nested while loops
    in_branch: bool  # inside a conditional's branch computation (at any depth)
    computation: str


def _shapes(result_type: str) -> tuple:
    result_type = re.sub(r"/\*index=\d+\*/", "", result_type)
    return tuple(
        tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", result_type)
    )


def _callees(line: str):
    """(callee, kind) pairs a line calls: kind is "body", "branch" or "call"."""
    for kind, callee in re.findall(r"(body|calls|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)", line):
        yield callee, "body" if kind == "body" else "branch" if kind.endswith("_computation") else "call"
    for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        for callee in re.findall(r"%([\w.\-]+)", group):
            yield callee, "branch"


def collectives(hlo_text: str) -> list[Collective]:
    computation, callers, found = None, {}, []
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
            continue
        for callee, kind in _callees(line):
            callers.setdefault(callee, (computation, kind))
        op = re.search(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line)
        if op:
            found.append((computation, op.group(2), _shapes(op.group(1))))

    def context(name):
        depth, branch, hops = 0, False, 0
        while name in callers and hops < 100:
            name, kind = callers[name]
            depth += kind == "body"
            branch |= kind == "branch"
            hops += 1
        return depth, branch

    return [Collective(op, shapes, *context(comp), comp) for comp, op, shapes in found]
