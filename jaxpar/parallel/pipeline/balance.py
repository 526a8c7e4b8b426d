"""Which layers each pipeline stage runs: explicit splits, and `auto` splits balanced by cost.

A split is a tuple of layer counts, one per global stage (placed on ranks by the schedule
table's stage map), summing to the staged layers (`ModelFacts.pipeline_layers`: `model.num_hidden_layers`
less the blocks an end stage runs on its own, DeepSeek-V3's leading dense layers); every stage has at least one layer. The engine
runs any such split (`layout.py`); `auto` picks the one with the most even per-stage cost.

The cost model is analytic, in forward FLOPs per token (the model's facts: `ModelFacts.layer_flops`,
`vocab_flops`, the one FLOP model of `jaxpar.model_facts`), and knows
what this engine does per microbatch and stage: F runs the stage's layers once; B recomputes them
from the stashed input and then runs the backward (2×), so a stage costs 4× its layers' forward
(5× with zb_h1's split backward: B and W each recompute). The vocab work (embedding lookup, final
norm, LM head and loss, forward + backward = 3×, no recompute) is vocab-parallel over `pipeline`
(`vocab.py`, `parallel.pipeline_vocab="spread"`, the default): every rank does 1/p of it, so it
does not favour any stage. With `parallel.pipeline_vocab="ends"` (the layout the source article
balances, and Megatron's default) the first stage embeds (a gather: almost free) and the last one
runs norm + head + loss in its F, so `auto` gives the last stage fewer layers.

Auto: the largest per-stage cost is minimised exactly (water-filling: each layer goes to the
stage that stays cheapest); among the splits with that maximum (e.g. which stages take the extra
layer when p·v does not divide L) the one with the shortest modelled step time on the run's
schedule table wins (`schedule_times`: lockstep SPMD, a step lasts as long as its busiest rank).
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxpar.parallel.pipeline.schedules import make_schedule
from jaxpar.parallel.pipeline.table import B, F, Schedule, W

AUTO = "auto"
PLACEMENTS = ("spread", "ends")
_MAX_CANDIDATES = 256  # tied splits whose step time is modelled; beyond that, the first ones


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per global stage and microbatch, in forward FLOPs per token: F, B and W (0 unless the
    backward is split); `vocab_per_rank` is what each rank spends on the vocab work per microbatch
    ("spread") — with "ends" it is folded into the first and last stages' F and B instead."""

    forward: tuple
    backward: tuple
    weight: tuple
    vocab_per_rank: float

    def totals(self, num_ranks: int) -> tuple:
        return tuple(f + b + w + self.vocab_per_rank / (len(self.forward) // num_ranks)
                     for f, b, w in zip(self.forward, self.backward, self.weight))


def stage_costs(facts, seq_len: int, split, num_ranks: int, *, split_backward: bool, placement: str = "spread"):
    """Per-stage costs of `split` in this engine (`facts`: the model's `ModelFacts`), with the vocab
    work placed as `placement` says."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    layer, vocab = facts.layer_flops(seq_len), facts.vocab_flops()
    forward = [n * layer for n in split]
    backward = [(2 if split_backward else 3) * n * layer for n in split]
    weight = [(2 * n * layer if split_backward else 0.0) for n in split]
    if placement == "spread":
        return StageCosts(tuple(forward), tuple(backward), tuple(weight), 3 * vocab / num_ranks)
    # "ends": the first stage's F also embeds (a gather: ~2·D per token), the last stage's F also
    # runs the head's forward and backward (kept, not recomputed by its B).
    embed = 2.0 * facts.hidden
    forward[0] += embed
    forward[-1] += 3 * (vocab - embed)
    return StageCosts(tuple(forward), tuple(backward), tuple(weight), 0.0)


def schedule_times(schedule: Schedule, costs: StageCosts) -> tuple[list, float]:
    """(busy time per rank, step time) of one training step under the lockstep SPMD model: every
    time step lasts as long as its busiest rank's cell; the vocab work runs on every rank at the
    steps where the last stage runs F. Units: those of `costs`, per token of one microbatch."""
    p, last = schedule.num_ranks, schedule.num_stages - 1
    cost = {F: costs.forward, B: costs.backward, W: costs.weight}
    busy, total = [0.0] * p, 0.0
    for row in schedule.grid:
        cells = [sum(cost[a.kind][schedule.global_stage(r, a.vstage)] for a in cell) for r, cell in enumerate(row)]
        if any(a.kind == F and schedule.global_stage(r, a.vstage) == last for r, cell in enumerate(row) for a in cell):
            cells = [c + costs.vocab_per_rank for c in cells]
        busy = [b + c for b, c in zip(busy, cells)]
        total += max(cells)
    return busy, total


def _water_fill(layers: int, stages: int, extra: list, layer: float) -> tuple[int, ...]:
    counts = [1] * stages
    for _ in range(layers - stages):
        s = min(range(stages), key=lambda i: (extra[i] + (counts[i] + 1) * layer, i))
        counts[s] += 1
    return tuple(counts)


def _candidates(layers: int, caps: list):
    """Splits with 1 <= n_s <= caps[s] summing to `layers`, in lexicographic order."""
    def rec(s, left):
        if s == len(caps) - 1:
            if 1 <= left <= caps[s]:
                yield (left,)
            return
        rest = sum(caps[s + 1:])
        for n in range(max(1, left - rest), min(caps[s], left - (len(caps) - 1 - s)) + 1):
            for tail in rec(s + 1, left - n):
                yield (n,) + tail
    return rec(0, layers)


def auto_split(facts, seq_len: int, table: Schedule, *sizes, placement: str = "spread"):
    """The split of the model's layers (`facts`: its `ModelFacts`) over the table's stages with the smallest largest
    stage cost, ties broken by the modelled step time of `table` (see the module docstring).
    (`table` may still be a schedule name followed by p, m[, v], the form scripts/ use.)"""
    if isinstance(table, str):
        table = make_schedule(table, *sizes)
    p, layers, stages = table.num_ranks, facts.pipeline_layers, table.num_stages
    if layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages} stages (each needs at least one)")
    split_b = table.split_backward
    one = stage_costs(facts, seq_len, (1,) * stages, p, split_backward=split_b, placement=placement)
    none = stage_costs(facts, seq_len, (0,) * stages, p, split_backward=split_b, placement=placement)
    unit = one.totals(p)[0] - none.totals(p)[0]  # one layer's cost on a stage
    extra = list(none.totals(p))
    greedy = _water_fill(layers, stages, extra, unit)
    worst = max(e + n * unit for e, n in zip(extra, greedy))
    caps = [max(1, int((worst - e) / unit + 1e-9)) for e in extra]

    def step_time(split):
        costs = stage_costs(facts, seq_len, split, p, split_backward=split_b, placement=placement)
        return schedule_times(table, costs)[1]

    tied = list(itertools.islice(_candidates(layers, caps), _MAX_CANDIDATES)) or [greedy]
    return min(tied, key=lambda split: (step_time(split), split))


def parse_split(value) -> str | tuple[int, ...]:
    """`parallel.pipeline_stage_layers` as AUTO or a tuple of ints: accepts "auto", a list or
    tuple of ints, or a comma-separated string ("21,20,20,19"). Raises ValueError otherwise."""
    if isinstance(value, str):
        text = value.strip()
        if text == AUTO:
            return AUTO
        try:
            return tuple(int(x) for x in text.strip("[]()").split(","))
        except ValueError:
            raise ValueError(f"not 'auto' or a comma-separated list of layer counts: {value!r}") from None
    if isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return tuple(value)
    raise ValueError(f"not 'auto' or a list of layer counts: {value!r}")


def split_problems(split, layers: int, p: int, v: int, what: str = "") -> list[str]:
    """Why an explicit split does not fit L layers (`what` they are; default model.num_hidden_layers=L)
    on p ranks × v virtual stages (empty: fine)."""
    problems = []
    if len(split) != p * v:
        problems.append(f"has {len(split)} entries, needs one per stage: mesh.pipeline × parallel.virtual_stages={p * v}")
    if any(n < 1 for n in split):
        problems.append("every stage needs at least one layer")
    if sum(split) != layers:
        problems.append(f"sums to {sum(split)}, not {what or f'model.num_hidden_layers={layers}'}")
    return problems


def cost_shares(costs: StageCosts, num_ranks: int) -> list[float]:
    """Each global stage's share of the total per-microbatch cost (sums to 1)."""
    totals = costs.totals(num_ranks)
    return [t / sum(totals) for t in totals]


def split_report(facts, seq_len: int, schedule: Schedule, split, placement: str = "spread") -> list[str]:
    """Lines describing a split on a schedule: layers and cost share per stage, and the modelled
    busy time per rank against the step time (lockstep SPMD, `schedule_times`)."""
    p = schedule.num_ranks
    costs = stage_costs(facts, seq_len, split, p, split_backward=schedule.split_backward, placement=placement)
    busy, total = schedule_times(schedule, costs)
    shares = ", ".join(f"{100 * s:.1f}%" for s in cost_shares(costs, p))
    return [
        f"stage layers ({placement} vocab): {list(split)}",
        f"cost share per stage (layers + vocab work, {facts.layer_flops(seq_len) / 1e6:.1f} MFLOP/token per "
        f"layer forward, {facts.vocab_flops() / 1e6:.1f} vocab): [{shares}]",
        "modelled busy time per rank / step time: [" + ", ".join(f"{b / total:.3f}" for b in busy) + "]"
        f" (idle {1 - sum(busy) / (p * total):.3f})",
    ]
