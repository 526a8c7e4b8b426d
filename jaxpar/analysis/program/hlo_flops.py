"""Matmul FLOPs of a compiled module, counted from its HLO with loop trip counts applied.

`compiled.cost_analysis()["flops"]` counts a while loop's body once, so a step whose layers run
in a `lax.scan` reports one layer's work. This counts every `dot` (2 · result elements ·
contracted size) and `convolution`-free programs only, times the executions of the computation it
sits in (through fusions, calls, loops and branches, as `jaxpar.analysis.program.hlo` counts them).
Elementwise work is not counted: for transformer steps it is a few percent.
"""

from __future__ import annotations

import math
import re

from jaxpar.analysis.program.hlo import _call_sites, _contexts, parse_computations, parse_tensors


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    match = re.search(re.escape(key) + r"=\{([\d,]*)\}", attrs)
    return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def matmul_flops(hlo_text: str) -> tuple[float, bool]:
    """(FLOPs per step of all dots, whether any sits in a conditional branch: then an upper bound)."""
    computations = parse_computations(hlo_text)
    contexts = _contexts(computations, _call_sites(computations))
    total, in_branch = 0.0, False
    for comp in computations.values():
        types = dict(comp.parameter_types)
        types.update({inst.name: inst.type_text for inst in comp.instructions})
        for inst in comp.instructions:
            if inst.opcode != "dot":
                continue
            (result,) = parse_tensors(inst.type_text)
            lhs = parse_tensors(types[inst.operand_names[0]])[0]
            contracted = math.prod(lhs.shape[d] for d in _dims(inst.attributes, "lhs_contracting_dims"))
            ctx = contexts[comp.name]
            total += 2.0 * math.prod(result.shape) * contracted * ctx.executions
            in_branch |= ctx.in_branch
    return total, in_branch
