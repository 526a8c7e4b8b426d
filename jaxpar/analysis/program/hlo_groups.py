"""Replica groups of HLO collectives, in the three spellings XLA prints (see `jaxpar.analysis.program.hlo`):
explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, and Shardy's mesh axes
`mesh['a'=2,'b'=4] {'b'}`, each expanded to tuples of logical device ids."""

from __future__ import annotations

import math
import re

import numpy as np


class HloParseError(ValueError):
    """HLO text this reader does not understand (the message quotes the offending piece)."""



def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def iota_groups(spec: str) -> tuple[tuple[int, ...], ...]:
    """`[G,N]<=[d0,d1,...]T(p...)`: iota over prod(d) reshaped to d, transposed by p, read as G rows."""
    match = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec.strip())
    if not match:
        raise HloParseError(f"not an iota replica group list: {spec!r}")
    shape, reshape = _ints(match.group(1)), _ints(match.group(2))
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if match.group(3):
        ids = ids.transpose(_ints(match.group(3)))
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1))


def _tile_assignment(spec: str, count: int) -> np.ndarray:
    """A `device_ids=(...)` list: `[d...]T(p...)` (an iota reshaped and transposed) or explicit ids."""
    spec = spec.strip()
    match = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if match:
        dims = _ints(match.group(1))
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match.group(2):
            ids = ids.transpose(_ints(match.group(2)))
        return ids.reshape(-1)
    ids = np.array(_ints(spec))
    if ids.size != count:
        raise HloParseError(f"device_ids=({spec}) lists {ids.size} ids for a mesh of {count}")
    return ids


def mesh_axes_groups(spec: str) -> tuple[tuple[int, ...], ...]:
    """Shardy's `mesh['a'=2,'b'=4](, device_ids=(...))? {'b', 'a':(1)2}` replica group list."""
    match = re.fullmatch(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*)\))?\s*\{([^}]*)\}", spec.strip())
    if not match:
        raise HloParseError(f"not a mesh-axes replica group list: {spec!r}")
    names, sizes = [], []
    for axis in match.group(1).split(","):
        axis_name, size = axis.rsplit("=", 1)
        names.append(axis_name.strip().strip("'\""))
        sizes.append(int(size))
    count = math.prod(sizes)
    devices = _tile_assignment(match.group(2), count) if match.group(2) else np.arange(count)
    # Split each mesh axis into the sub-axes the group list names, then move the grouped
    # (sub-)axes last: each row of the result is one group.
    refs = []
    for ref in match.group(3).split(","):
        ref = ref.strip()
        if not ref:
            continue
        sub = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", ref)
        if not sub:
            raise HloParseError(f"bad axis reference {ref!r} in {spec!r}")
        axis = names.index(sub.group(1))
        pre, size = (int(sub.group(2)), int(sub.group(3))) if sub.group(2) else (1, sizes[axis])
        refs.append((axis, pre, size))
    dims, grouped = [], []
    for axis, full in enumerate(sizes):
        mine = sorted((pre, size, k) for k, (a, pre, size) in enumerate(refs) if a == axis)
        prefix = 1
        for pre, size, k in mine:
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped.append((k, len(dims)))
            dims.append(size)
            prefix *= size
        if prefix != full or not mine:
            dims.append(full // prefix)
    order = [d for _, d in sorted(grouped)]
    rest = [d for d in range(len(dims)) if d not in order]
    per_group = math.prod(dims[d] for d in order)
    table = devices.reshape(dims).transpose(rest + order).reshape(-1, per_group)
    return tuple(tuple(int(i) for i in row) for row in table)


def parse_replica_groups(spec: str) -> tuple[tuple[int, ...], ...] | None:
    spec = spec.strip()
    if spec.startswith("mesh["):
        return mesh_axes_groups(spec)
    if spec.startswith("["):
        return iota_groups(spec)
    if spec.startswith("{"):
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", spec[1:-1]))
        return groups or None
    raise HloParseError(f"unknown replica_groups form: {spec!r}")
