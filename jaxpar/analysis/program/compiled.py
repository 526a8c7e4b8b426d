"""What XLA actually compiles for jaxpar's training step: memory, FLOPs and collectives per device.

`compile_step(config)` builds the real program (`jaxpar.train.setup.build`), traces the state
with `jax.eval_shape(program.init)` and a `ShapeDtypeStruct` batch, and AOT-compiles
`program.step.lower(state, batch)`: nothing is allocated, so a 70B-shaped config compiles on a
laptop (host RAM only holds the compiler's own data). On this project's test machines the
devices are emulated CPU devices (`--xla_force_host_platform_device_count`).

Collective bytes use the convention of `jaxpar.analysis.program.wire.wire_bytes` (per participating
device, ring algorithms), the same the analytic model uses, so the two compare directly.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

from jax.sharding import Mesh

from jaxpar.analysis.program import hlo
from jaxpar.analysis.program.hlo_flops import matmul_flops
from jaxpar.analysis.program.wire import wire_bytes
from jaxpar.axes import PIPELINE


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Per-device bytes from `memory_analysis()`."""

    argument: int
    output: int
    alias: int  # outputs written into donated arguments
    temp: int
    peak: int  # XLA's own peak estimate (`peak_memory_in_bytes`)

    @property
    def live_total(self) -> int:
        """Arguments + non-aliased outputs + temporaries: every byte the step needs at once at most."""
        return self.argument + self.output - self.alias + self.temp


@dataclasses.dataclass(frozen=True)
class CommTotal:
    """All collectives of one kind over one set of mesh axes, per step."""

    kind: str
    axes: tuple[str, ...]
    group_size: int
    instructions: int
    executions: int  # instructions × their per-step executions
    size_bytes: int  # sum of size × executions (see `hlo.Collective.size_bytes`)
    wire_bytes: float  # per participating device (`comm.wire_bytes`)
    in_branch: bool  # some of them sit in a conditional branch: counts are upper bounds
    partial_axes: bool  # some groups are a sub-axis of these axes


@dataclasses.dataclass
class CompiledStep:
    mesh: Mesh
    compile_seconds: float
    memory: CompiledMemory
    reported_flops: float  # cost_analysis()["flops"]: while bodies counted once
    hlo_matmul_flops: float  # every dot with loop trip counts applied (hlo_flops)
    matmul_flops_upper_bound: bool  # some dots sit in conditional branches
    collectives: list[hlo.Collective]
    hlo_text: str | None
    conditionals: dict = dataclasses.field(default_factory=dict)  # name -> (branches, executions per step)

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    def comm_totals(self, branch_runs: dict | None = None) -> list[CommTotal]:
        """Collectives summed by (kind, mesh axes), biggest wire bytes first.

        `branch_runs`: {(conditional, branch index): runs per step} for conditionals whose
        branch counts are known (one device's, e.g. from a pipeline schedule table); a
        collective in such a branch then counts those runs (times the loops outside the
        conditional's loop are not re-applied: the runs are per step) instead of the upper bound."""
        groups = defaultdict(list)
        for c in self.collectives:
            groups[(c.kind, hlo.mesh_axes_of(c, self.mesh))].append(c)
        totals = []
        for (kind, axes), members in groups.items():
            n = members[0].group_size(self.num_devices)
            runs = [self._runs(c, branch_runs) for c in members]
            totals.append(
                CommTotal(
                    kind=kind,
                    axes=axes,
                    group_size=n,
                    instructions=len(members),
                    executions=sum(runs),
                    size_bytes=sum(c.size_bytes(self.num_devices) * r for c, r in zip(members, runs)),
                    wire_bytes=sum(
                        wire_bytes(kind, c.size_bytes(self.num_devices), c.group_size(self.num_devices)) * r
                        for c, r in zip(members, runs)
                    ),
                    in_branch=any(c.in_branch and not _known(c, branch_runs) for c in members),
                    partial_axes=not all(hlo.spans_whole_axes(c, self.mesh) for c in members),
                )
            )
        return sorted(totals, key=lambda t: -t.wire_bytes)

    def _runs(self, c: hlo.Collective, branch_runs: dict | None) -> float:
        """Executions per step: a known branch's runs times the loops inside the branch (the
        counted executions over the conditional's own), else the counted upper bound."""
        key = _known(c, branch_runs)
        if key is None:
            return c.executions
        return branch_runs[key] * c.executions / self.conditionals[key[0]][1]

    def wire_bytes_by_axes(self, branch_runs: dict | None = None) -> dict[tuple[str, ...], float]:
        out = defaultdict(float)
        for t in self.comm_totals(branch_runs):
            out[t.axes] += t.wire_bytes
        return dict(out)


def _known(c: hlo.Collective, branch_runs: dict | None):
    """The outermost enclosing (conditional, branch) whose runs are known, or None."""
    for key in c.branch if branch_runs else ():
        if key in branch_runs:
            return key
    return None


def compile_step(config, devices=None, *, keep_text: bool = False, checked: bool = False) -> CompiledStep:
    """AOT-compiles jaxpar's train step for `config` on `devices` (default: all). `checked`: run
    `jaxpar.train.preflight.check` first (`ConfigError`, one line per problem), as scripts taking user
    input do; the sweep's candidates were screened by preflight already."""
    from jaxpar.train.fit import abstract_inputs  # late: keeps `import jaxpar.analysis` light
    from jaxpar.train.harness import checked_build
    from jaxpar.train.setup import build

    start = time.perf_counter()
    program = (checked_build if checked else build)(config, devices)
    state, batch = abstract_inputs(program, config)
    compiled = program.step.lower(state, batch).compile()
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    text = compiled.as_text()
    flops, upper = matmul_flops(text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return CompiledStep(
        mesh=program.mesh,
        compile_seconds=seconds,
        memory=CompiledMemory(
            argument=stats.argument_size_in_bytes,
            output=stats.output_size_in_bytes,
            alias=stats.alias_size_in_bytes,
            temp=stats.temp_size_in_bytes,
            peak=stats.peak_memory_in_bytes,
        ),
        reported_flops=float(cost.get("flops", 0.0)),
        hlo_matmul_flops=flops,
        matmul_flops_upper_bound=upper,
        collectives=hlo.collectives(text),
        hlo_text=text if keep_text else None,
        conditionals=hlo.conditionals(text),
    )


def pipeline_traffic(hlo_text: str, mesh) -> dict:
    """Bytes over `pipeline` alone per step (buffer sizes, `Collective.size_bytes`, times their
    executions), split into "layers" — collective-permutes outside any loop, i.e. outside the
    schedule's scan: the engine's layer exchange into stage order and its transpose
    (`parallel/pipeline/layout.py`) — and "step": everything else (activations, gradients, the
    vocab-parallel reductions inside the scan; the loss psum after it)."""
    out = {"layers": 0, "step": 0}
    for c in hlo.collectives(hlo_text):
        if hlo.mesh_axes_of(c, mesh) != (PIPELINE,):
            continue
        key = "layers" if c.kind == hlo.COLLECTIVE_PERMUTE and c.loop_depth == 0 else "step"
        out[key] += c.size_bytes(mesh.devices.size) * c.executions
    return out
