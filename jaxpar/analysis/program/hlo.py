"""Reads the collectives out of compiled HLO text (`compiled.as_text()`).

For every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute (sync, or
the `-start` half of an async pair) it gives: result and operand tensors (dtype, shape, bytes), the
replica groups expanded to device ids, or the source→target pairs, the computation it sits in, the
while loops around it and how often it runs per step, and whether it sits in a branch of a
`conditional`. Every instruction also carries the `op_name` of its metadata (the
`jax.named_scope` path it was traced under), which `jaxpar.analysis.program.profile` maps to model scopes.

Replica groups come in three spellings, all expanded here:
  explicit   `{{0,1},{2,3}}`                 (`{}`: one group of every device)
  iota       `[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)` (reshape iota(N), transpose, rows are groups)
  mesh axes  `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, optionally `, device_ids=(...)` and
             sub-axes `'a':(pre)size` (Shardy's form: devices that differ only along the listed
             axes form a group).
Ids are logical device ids: position in the executable's device assignment, which for a jitted
function over a `jax.sharding.Mesh` is `mesh.devices.flat`, so `mesh_axes_of` maps them to mesh
coordinates with an unravel over the mesh shape.

Execution counts. A while loop's body runs `known_trip_count` times (from the loop's
backend_config); a collective's `executions` is the product over its enclosing loops. A loop
without a known trip count counts as 1 and clears `trip_counts_known` (the count is then a lower
bound). A collective inside a `conditional` branch (`branch_computations={...}` or
`true_computation=` / `false_computation=`) is counted as if its branch ran every time the
conditional does (an upper bound: which branch runs is data), has `in_branch` set, and names its
(conditional, branch index) in `branch`, so a caller who knows how often each branch runs (the
pipeline's schedule table does) can count exactly (`jaxpar.analysis.program.compiled`).
Replica-group spellings are read by `jaxpar.analysis.program.hlo_groups`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from jaxpar.analysis.program.hlo_groups import (  # noqa: F401 (iota_groups, mesh_axes_groups: re-exported)
    HloParseError,
    _ints,
    iota_groups,
    mesh_axes_groups,
    parse_replica_groups,
)

ALL_REDUCE = "all-reduce"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_TO_ALL = "all-to-all"
COLLECTIVE_PERMUTE = "collective-permute"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, COLLECTIVE_PERMUTE)

# Bytes per element; sub-byte types round up (never seen in jaxpar's programs).
DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1,
    "token": 0,
}


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]

    @property
    def bytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise HloParseError(f"unknown HLO element type {self.dtype!r}")
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Collective:
    name: str  # instruction name, e.g. "all-reduce.13"
    kind: str  # one of KINDS
    is_async: bool  # the `-start` form
    computation: str
    results: tuple[Tensor, ...]  # several for a combined (tuple-shaped) op
    operands: tuple[Tensor, ...]  # from the operands' definitions; () where not found
    groups: tuple[tuple[int, ...], ...] | None  # None: one group of all devices (or a permute)
    pairs: tuple[tuple[int, int], ...] | None  # collective-permute only
    dimensions: tuple[int, ...]  # gather / scatter / split dimension(s), where the op has one
    trip_counts: tuple[int | None, ...]  # enclosing while loops, outermost first
    in_branch: bool
    executions: int  # per step: product of known trip counts (see the module docstring)
    trip_counts_known: bool
    # The conditionals around it, outermost first: ((conditional instruction, branch index), ...).
    branch: tuple = ()
    op_name: str = ""  # the instruction's metadata op_name (`Instruction.op_name`)

    @property
    def loop_depth(self) -> int:
        return len(self.trip_counts)

    @property
    def result_bytes(self) -> int:
        return sum(t.bytes for t in self.results)

    def group_size(self, num_devices: int | None = None) -> int:
        if self.kind == COLLECTIVE_PERMUTE:
            return 2
        if self.groups is None:
            if num_devices is None:
                raise ValueError(f"{self.name}: replica groups span all devices; pass num_devices")
            return num_devices
        return len(self.groups[0])

    def size_bytes(self, num_devices: int | None = None) -> int:
        """The full buffer one collective moves, per device: all-reduce, all-to-all, permute: the
        buffer; all-gather: the gathered result; reduce-scatter: the operand before scattering."""
        if self.kind == REDUCE_SCATTER:
            return self.result_bytes * self.group_size(num_devices)
        return self.result_bytes


# ---- text → computations and instructions ---------------------------------------------------------


@dataclass
class Instruction:
    name: str
    type_text: str
    opcode: str
    operand_names: tuple[str, ...]
    attributes: str
    op_name: str = ""  # metadata={op_name="..."}: the traced source scope path; "" if none


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction] = field(default_factory=list)
    parameter_types: dict[str, str] = field(default_factory=dict)


_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_TENSOR = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MODULE = re.compile(r"^HloModule\s+([\w.\-]+)", re.M)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise HloParseError(f"unbalanced brackets in: {text[start:start + 120]!r}")


def _split_instruction(name: str, rest: str) -> Instruction:
    rest = _INDEX_COMMENT.sub("", rest).strip()
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ")
    type_text, rest = rest[:end], rest[end:].strip()
    paren = rest.find("(")
    if paren < 0:
        raise HloParseError(f"no operand list after %{name} = {type_text}: {rest[:80]!r}")
    opcode = rest[:paren].strip()
    close = _balanced(rest, paren)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[paren:close]))
    attributes = rest[close:]
    op_name = _OP_NAME.search(attributes)
    return Instruction(name, type_text, opcode, operands, attributes, op_name.group(1) if op_name else "")


def parse_computations(text: str) -> dict[str, Computation]:
    computations: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = Computation(header.group(2), bool(header.group(1)))
            computations[current.name] = current
            for pname, ptype in re.findall(r"([\w.\-]+):\s*((?:\([^)]*\))|[^,()]+(?:\{[^}]*\})?)", header.group(3)):
                current.parameter_types[pname] = ptype.strip()
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            current.instructions.append(_split_instruction(match.group(1), match.group(2)))
    if not computations:
        raise HloParseError("no HLO computations found (expected `compiled.as_text()` output)")
    return computations


def instructions(text: str) -> dict[str, Instruction]:
    """Every instruction of the module by name (names are unique within a module)."""
    return {inst.name: inst for comp in parse_computations(text).values() for inst in comp.instructions}


def module_name(text: str) -> str:
    """The module's name from its `HloModule` line ("" if there is none)."""
    match = _MODULE.search(text)
    return match.group(1) if match else ""


def parse_tensors(type_text: str) -> tuple[Tensor, ...]:
    """All array types in a (possibly tuple) HLO type, layouts ignored: `(f32[2,3]{1,0}, s32[])`."""
    type_text = _INDEX_COMMENT.sub("", type_text)
    out = []
    for dtype, dims in _TENSOR.findall(type_text):
        dims = [d.replace("<=", "").strip() for d in dims.split(",") if d.strip()]
        out.append(Tensor(dtype, tuple(int(d) for d in dims)))
    return tuple(out)


# ---- replica groups -----------------------------------------------------------------------------------


def _attribute(attrs: str, key: str) -> str | None:
    """The raw value of `key=` in an attribute list (bracketed values kept whole)."""
    match = re.search(r"(?:^|[,\s])" + re.escape(key) + r"=", attrs)
    if not match:
        return None
    i = match.end()
    if attrs.startswith("mesh[", i):  # mesh[...](, device_ids=(...))? {...}
        end = _balanced(attrs, i + 4)
        device_ids = re.match(r",\s*device_ids=", attrs[end:])
        if device_ids:
            end = _balanced(attrs, end + device_ids.end())
        brace = attrs.index("{", end)
        return attrs[i:_balanced(attrs, brace)]
    if attrs[i] in "{[(":
        end = _balanced(attrs, i)
        if attrs[i] == "[" and attrs.startswith("<=", end):  # iota: [G,N]<=[..]T(..)
            end = _balanced(attrs, end + 2)
            if attrs.startswith("T(", end):
                end = _balanced(attrs, end + 1)
        return attrs[i:end]
    end = re.search(r"[,\s]|$", attrs[i:]).start() + i
    return attrs[i:end]


# ---- the call graph: loops, branches, execution counts ------------------------------------------


@dataclass(frozen=True)
class _Site:
    caller: str
    trip_count: int | None  # for a while body; None for unknown
    is_loop: bool
    is_branch: bool
    branch: tuple = ()  # (conditional instruction, branch index) for a branch site


def _call_sites(computations: dict[str, Computation]) -> dict[str, list[_Site]]:
    sites: dict[str, list[_Site]] = {}
    for comp in computations.values():
        for inst in comp.instructions:
            attrs = inst.attributes
            if inst.opcode == "while":
                trip = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', attrs)
                n = int(trip.group(1)) if trip else None
                body, cond = _attribute(attrs, "body"), _attribute(attrs, "condition")
                if body:
                    sites.setdefault(body.lstrip("%"), []).append(_Site(comp.name, n, True, False))
                if cond:
                    sites.setdefault(cond.lstrip("%"), []).append(_Site(comp.name, n, True, False))
                continue
            if inst.opcode == "conditional":
                branches = _attribute(attrs, "branch_computations")
                names = re.findall(r"%([\w.\-]+)", branches) if branches else []
                for key in ("true_computation", "false_computation"):
                    value = _attribute(attrs, key)
                    if value:
                        names.append(value.lstrip("%"))
                for index, name in enumerate(names):
                    sites.setdefault(name, []).append(_Site(comp.name, 1, False, True, (inst.name, index)))
                continue
            for key in ("calls", "to_apply"):
                value = _attribute(attrs, key)
                if value:
                    for name in re.findall(r"%([\w.\-]+)", value):
                        sites.setdefault(name, []).append(_Site(comp.name, 1, False, False))
    return sites


@dataclass(frozen=True)
class _Context:
    trip_counts: tuple[int | None, ...]
    in_branch: bool
    executions: int
    known: bool
    branch: tuple = ()  # enclosing (conditional, branch index) pairs, outermost first


def _contexts(computations, sites) -> dict[str, _Context]:
    memo: dict[str, _Context] = {}

    def context(name: str, seen: frozenset) -> _Context:
        if name in memo:
            return memo[name]
        callers = sites.get(name, [])
        if not callers or name in seen:
            result = _Context((), False, 1, True)
        else:
            # Several call sites: executions add up; loops and branches follow the first site.
            parts = []
            for site in callers:
                outer = context(site.caller, seen | {name})
                trips = outer.trip_counts + ((site.trip_count,) if site.is_loop else ())
                mult = (site.trip_count or 1) if site.is_loop else 1
                parts.append(
                    _Context(
                        trips,
                        outer.in_branch or site.is_branch,
                        outer.executions * mult,
                        outer.known and not (site.is_loop and site.trip_count is None),
                        outer.branch + ((site.branch,) if site.is_branch else ()),
                    )
                )
            first = parts[0]
            result = _Context(
                first.trip_counts,
                any(p.in_branch for p in parts),
                sum(p.executions for p in parts),
                all(p.known for p in parts),
                first.branch,
            )
        memo[name] = result
        return result

    return {name: context(name, frozenset()) for name in computations}


# ---- collectives ------------------------------------------------------------------------------------------

_KIND = re.compile(r"^(" + "|".join(KINDS) + r")(-start)?$")


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in the module, in text order (async pairs counted once, at `-start`)."""
    computations = parse_computations(hlo_text)
    contexts = _contexts(computations, _call_sites(computations))
    found = []
    for comp in computations.values():
        types = dict(comp.parameter_types)
        types.update({inst.name: inst.type_text for inst in comp.instructions})
        done_types = {
            inst.operand_names[0]: inst.type_text
            for inst in comp.instructions
            if inst.opcode.endswith("-done") and inst.operand_names
        }
        for inst in comp.instructions:
            kind = _KIND.match(inst.opcode)
            if not kind:
                continue
            is_async = bool(kind.group(2))
            operands = tuple(t for name in inst.operand_names if name in types for t in parse_tensors(types[name]))
            results = parse_tensors(done_types.get(inst.name, inst.type_text))
            if is_async and inst.name not in done_types:
                results = _async_results(kind.group(1), results, len(operands))
            groups = pairs = None
            spec = _attribute(inst.attributes, "replica_groups")
            if spec is not None:
                groups = parse_replica_groups(spec)
            stp = _attribute(inst.attributes, "source_target_pairs")
            if stp is not None:
                pairs = tuple(tuple(p) for p in (_ints(g) for g in re.findall(r"\{(\d+,\d+)\}", stp)))
            dims = _attribute(inst.attributes, "dimensions")
            ctx = contexts[comp.name]
            found.append(
                Collective(
                    name=inst.name,
                    kind=kind.group(1),
                    is_async=is_async,
                    computation=comp.name,
                    results=results,
                    operands=operands,
                    groups=groups,
                    pairs=pairs,
                    dimensions=tuple(_ints(dims)) if dims else (),
                    trip_counts=ctx.trip_counts,
                    in_branch=ctx.in_branch,
                    executions=ctx.executions,
                    trip_counts_known=ctx.known,
                    branch=ctx.branch,
                    op_name=inst.op_name,
                )
            )
    return found


def conditionals(hlo_text: str) -> dict[str, tuple[int, int]]:
    """{conditional instruction name: (number of branches, executions per step)} of the module."""
    computations = parse_computations(hlo_text)
    contexts = _contexts(computations, _call_sites(computations))
    out = {}
    for comp in computations.values():
        for inst in comp.instructions:
            if inst.opcode == "conditional":
                branches = _attribute(inst.attributes, "branch_computations")
                count = len(re.findall(r"%[\w.\-]+", branches)) if branches else 2
                out[inst.name] = (count, contexts[comp.name].executions)
    return out


def _async_results(kind: str, tensors: tuple[Tensor, ...], operand_count: int) -> tuple[Tensor, ...]:
    """Results of a `-start` whose `-done` was not found: all-reduce-start returns its results;
    all-gather / all-to-all / collective-permute starts return (operands, results[, contexts])."""
    if kind in (ALL_REDUCE,) or operand_count == 0:
        return tensors
    results = tensors[operand_count: 2 * operand_count]
    return results or tensors


# ---- device ids → mesh axes ------------------------------------------------------------------------


def mesh_axes_of(collective: Collective, mesh) -> tuple[str, ...]:
    """Mesh axes (in mesh order) along which the devices of one group (or one permute pair) differ.
    `mesh` is a `jax.sharding.Mesh` (anything with `axis_names` and `devices.shape`). A group of
    all devices spans every axis larger than 1."""
    names, shape = tuple(mesh.axis_names), tuple(np.shape(mesh.devices))
    if collective.kind == COLLECTIVE_PERMUTE:
        sets = [tuple(p) for p in collective.pairs or ()]
    elif collective.groups is None:
        return tuple(n for n, s in zip(names, shape) if s > 1)
    else:
        sets = collective.groups
    varying = set()
    count = math.prod(shape)
    for ids in sets:
        if any(i >= count for i in ids):
            raise ValueError(f"{collective.name}: device id {max(ids)} is outside a mesh of {count} devices")
        coords = np.array(np.unravel_index(np.array(ids), shape)).T  # [members, axes]
        varying.update(int(a) for a in np.nonzero((coords != coords[0]).any(axis=0))[0])
    return tuple(names[a] for a in sorted(varying))


def spans_whole_axes(collective: Collective, mesh) -> bool:
    """Whether each group is exactly the full product of the axes it spans (False: a sub-axis)."""
    if collective.kind == COLLECTIVE_PERMUTE or collective.groups is None:
        return True
    sizes = dict(zip(mesh.axis_names, np.shape(mesh.devices)))
    return len(collective.groups[0]) == math.prod(sizes[a] for a in mesh_axes_of(collective, mesh))
