"""plan.py's words a reader acts on: what limits the step, said in plain words, and where the
config's own layout (what a run without `--plan` uses) stands beside the winner.

References: preflight's own verdict on the config's layout (`check`), the cost model pricing that
layout on its own (`estimate`), and the plan's fitting layouts ranked by time.
"""

import re

import pytest

from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.planner import apply_layout, plan_text
from jaxpar.analysis.planner.search import plan_layouts
from jaxpar.train.preflight import ConfigError, check
from tests.support import tiny


def small_llama(**train):
    """Divisible by every split of 8 devices: 8 heads and KV heads, 8 layers, batch 64."""
    return tiny.llama({"global_batch_size": 64, "seq_len": 64, **train}, vocab_size=256, num_hidden_layers=8,
                      num_key_value_heads=8, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def plan():
    return plan_layouts(small_llama(), "h200", 8)


def test_what_limits_the_step_is_said_in_words(plan):
    text = plan_text.choice(plan)
    assert "Binding vertex" not in text and "binds" not in text
    (line,) = [line.strip() for line in text.splitlines() if "What limits" in line]
    # A small model on big devices: no faster layout overflows, so memory is not what limits it.
    assert line.startswith("What limits the step: compute, ") and line.endswith("Not memory: no layout priced is more than 2% faster, "
                                                                                 "fitting or not.")


def test_the_config_s_own_layout_is_placed_beside_the_winner(plan):
    best = plan.best
    winner = apply_layout(small_llama(), best.candidate.values)
    assert plan_text.own_layout(plan_layouts(winner, "h200", 8)) == f"The config's own layout, {best.describe()}, is the winner."

    runner_up = next(p for p in plan.fitting if p.describe() != best.describe() and p.seconds > 1.01 * best.seconds)
    own = apply_layout(small_llama(), runner_up.candidate.values)
    line = plan_text.own_layout(plan_layouts(own, "h200", 8))
    seconds = estimate(own, "h200", num_devices=8).time.seconds  # the layout priced on its own
    place = 1 + sum(p.seconds < seconds for p in plan.fitting)
    extra = round(100 * (seconds - best.seconds) / best.seconds)
    assert line.startswith(f"The config's own layout, {runner_up.describe()}, fits 8 x h200 and ranks {place} of the "
                           f"{len(plan.fitting)} layouts that fit: "), line
    assert f", +{extra}% over the winner; it spends " in line, line


def test_a_refused_own_layout_says_preflight_s_reason():
    config = small_llama(grad_accum=3)  # 64 rows over 8 replicas do not split into 3 microbatches
    with pytest.raises(ConfigError) as refused:
        check(config, 8)
    line = plan_text.own_layout(plan_layouts(config, "h200", 8, fixed=["train.grad_accum"]))
    assert re.fullmatch(r"The config's own layout, data=8 remat=none accum=3, is refused on 8 devices: .+", line), line
    assert line.endswith(str(refused.value).splitlines()[0])
