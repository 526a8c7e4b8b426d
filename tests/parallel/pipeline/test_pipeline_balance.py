"""Stage splits and their cost model (pure arithmetic, no devices).

`schedule_times` is checked against the schedules' own lockstep cost model (`step_costs`: F = 1,
B = 2, W = 1 per cell) on unit costs; `auto_split` against exhaustive search over all splits.
"""

import itertools

import numpy as np
import pytest

from jaxpar.models import facts
from jaxpar.parallel.pipeline import balance
from jaxpar.parallel.pipeline.schedules import make_schedule
from jaxpar.parallel.pipeline.table import step_costs
from tests.support import tiny
from tests.support.v_shape import v_table

SCHEDULES = [("gpipe", 2, 4, 1), ("1f1b", 3, 5, 1), ("interleaved_1f1b", 2, 4, 2), ("zb_h1", 4, 8, 1), ("zb_v", 3, 4, 2),
             ("dualpipev", 2, 5, 2)]


def table_of(name, p, m, v):
    return v_table(p, m, split_backward=True) if name == "v_split" else make_schedule(name, p, m, v)


@pytest.mark.parametrize("name, p, m, v", SCHEDULES + [("v_split", 3, 4, 2)])
def test_schedule_times_match_the_tables_lockstep_costs(name, p, m, v):
    table = table_of(name, p, m, v)
    stages = p * v
    split_b = table.split_backward
    unit = balance.StageCosts((1.0,) * stages, ((1.0 if split_b else 2.0),) * stages,
                              ((1.0 if split_b else 0.0),) * stages, 0.0)
    busy, total = balance.schedule_times(table, unit)
    assert total == step_costs(table).sum()
    assert busy == [3 * m * v] * p  # F + B (+ W) per microbatch and virtual stage


def all_splits(layers, stages):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        yield tuple(np.diff((0,) + cuts + (layers,)))


@pytest.mark.parametrize("layers, vocab, placement, name, p, m, v", [
    (7, 250, "spread", "1f1b", 2, 4, 1),
    (7, 380, "spread", "gpipe", 3, 4, 1),
    (7, 250, "spread", "interleaved_1f1b", 2, 4, 2),
    (8, 32000, "ends", "1f1b", 2, 4, 1),
    (9, 32000, "ends", "zb_h1", 3, 6, 1),
    (12, 16000, "ends", "interleaved_1f1b", 2, 4, 2),
    (9, 32000, "ends", "v_split", 3, 4, 2),  # both ends on rank 0
])
def test_auto_split_minimises_the_largest_stage_then_the_step_time(layers, vocab, placement, name, p, m, v):
    model = facts(tiny.llama(num_hidden_layers=layers, vocab_size=vocab).model)
    seq = 16
    table = table_of(name, p, m, v)

    def cost(split):
        costs = balance.stage_costs(model, seq, split, p, split_backward=table.split_backward, placement=placement)
        return max(costs.totals(p)), balance.schedule_times(table, costs)[1]

    best = min(all_splits(layers, p * v), key=cost)
    chosen = balance.auto_split(model, seq, table, placement=placement)
    assert sum(chosen) == layers and min(chosen) >= 1
    assert cost(chosen) == pytest.approx(cost(best), rel=1e-12), (chosen, best)


def test_spread_vocab_keeps_divisible_splits_equal_and_ends_unloads_the_last_stage():
    model = facts(tiny.llama(num_hidden_layers=8, vocab_size=32000, hidden_size=256).model)
    table = make_schedule("1f1b", 2, 4)
    assert balance.auto_split(model, 128, table) == (4, 4)
    ends = balance.auto_split(model, 128, table, placement="ends")
    assert ends[-1] < ends[0]
    # The name form scripts/ still use builds the same table.
    assert balance.auto_split(model, 128, "1f1b", 2, 4, placement="ends") == ends


def test_parse_split():
    assert balance.parse_split("auto") == "auto"
    assert balance.parse_split("21,20,20,19") == (21, 20, 20, 19)
    assert balance.parse_split([4, 3]) == (4, 3)
    for bad in ("four", [4.0, 3], 7, [True, 1]):
        with pytest.raises(ValueError):
            balance.parse_split(bad)
    assert balance.split_problems((4, 3), 7, 2, 1) == []
    assert len(balance.split_problems((4, 0, 3), 7, 2, 1)) == 2  # wrong length, empty stage
