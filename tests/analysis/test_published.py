"""Published GPU runs against the cost model (`jaxpar.analysis.reports.published`), and the table that says so.

- docs/experiments.md's table of published runs is exactly what the model computes now: a change to
  the model that moves a prediction must regenerate the document (scripts/experiments.py
  --sections=...,published), so the two cannot drift.
- Each GPU generation's matmul constant in `jaxpar.analysis.cost.hardware` is the fit on its named run
  (refitting gives it back), and no held-out run took part.
- Every held-out run's RAW error (predicted tokens/s over published, less one; nothing subtracted) is
  within ±25%, and the table's verdict says the same. Mixtral through jaxpar's pipeline engine misses
  by -32%: a known failure, a strict xfail (it fails the bound; if the model ever meets it the xfail
  passes and must be removed). The note that may explain its gap (`gap_note`) changes no verdict.
- The conversion of published model TFLOP/s to tokens/s follows Megatron-LM's own formula, written
  out independently here.
No compilation: arithmetic on configs.
"""

from __future__ import annotations

import pytest

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.reports import published as P
from jaxpar.models.families import facts
from tests.support.paths import REPO as ROOT


def test_the_documented_table_is_what_the_model_computes():
    doc = (ROOT / "docs" / "experiments.md").read_text().splitlines()
    table = P._table(P.HEADER, P.rows())
    start = doc.index(table[0])
    assert doc[start:start + len(table)] == table


def test_a_changed_model_would_change_the_table():
    # Positive control for the test above: a different constant gives different rows.
    import dataclasses

    run = P.RUNS[1]
    base = P.predict(run).tokens_per_second_per_device
    slower = dataclasses.replace(hw.get(run.hardware), matmul_efficiency=0.9 * hw.get(run.hardware).matmul_efficiency)
    assert f"{P.predict(run, slower).tokens_per_second_per_device:,.0f}" != f"{base:,.0f}"


@pytest.mark.parametrize("profile", sorted(P.FITTED))
def test_each_constant_is_the_fit_on_its_named_run(profile):
    run = next(r for r in P.RUNS if r.name == P.FITTED[profile])
    assert run.hardware == profile
    assert P.fit_matmul_efficiency(run) == pytest.approx(hw.get(profile).matmul_efficiency, abs=1e-3)
    assert abs(P.error(run)) < 0.005


HELD_OUT = [r for r in P.RUNS if P.FITTED.get(r.hardware) != r.name]
# Held-out runs the model misses, each with what may explain it (not a measurement: no 64-GPU run).
KNOWN_MISSES = {
    "Mixtral 8x7B, TP1 EP8 PP4 VP8": "-32%: the prediction prices jaxpar's pipeline engine (each stage's forward "
    "recomputed in its backward, pipeline and data exchanges not overlapped), Megatron's published run does neither",
}


def test_the_held_out_runs_cover_systems_and_families():
    assert len(P.RUNS) >= 6 and len(HELD_OUT) >= 4 and set(KNOWN_MISSES) <= {r.name for r in HELD_OUT}
    assert {r.system for r in P.RUNS} >= {"torchtitan", "MaxText", "Megatron-Core"}
    assert any(facts(r.model()).is_moe for r in HELD_OUT) and any(not facts(r.model()).is_moe for r in HELD_OUT)


def raw_error(run) -> float:
    return P.predict(run).tokens_per_second_per_device / run.published_tokens_per_gpu() - 1


@pytest.mark.parametrize("name", [r.name for r in P.RUNS])
def test_the_table_reports_the_raw_error(name):
    run = next(r for r in P.RUNS if r.name == name)
    raw = raw_error(run)
    assert P.error(run) == pytest.approx(raw, abs=1e-12)  # nothing subtracted, whatever the notes say
    row = next(row for row in P.rows() if row[0] == name)
    assert row[P.HEADER.index("error")] == f"{100 * raw:+.1f}%"
    if run in HELD_OUT:
        assert row[P.HEADER.index("verdict")] == ("held out, within ±25%" if abs(raw) <= 0.25 else "held out, OUTSIDE ±25%")


@pytest.mark.parametrize("name", [
    pytest.param(r.name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[r.name])) if r.name in KNOWN_MISSES else r.name
    for r in HELD_OUT
])
def test_held_out_run_within_the_bound(name):
    run = next(r for r in P.RUNS if r.name == name)
    raw = raw_error(run)
    assert abs(raw) <= P.TARGET_ERROR == 0.25, f"{name}: {100 * raw:+.1f}% off the published tokens/s per GPU"


def megatron_flops(model, batch: int, seq: int) -> float:
    """Megatron-LM's `num_floating_point_operations` (training.py, 2024), transcribed."""
    h, layers = model.hidden_size, model.num_hidden_layers
    heads, groups = model.num_attention_heads, model.num_key_value_heads
    kv_channels = h // heads
    ratio = kv_channels * heads / h
    routed = model.get("num_experts_per_tok", 1) if model.get("num_local_experts", 0) else 1
    vocab = -(-model.vocab_size // 128) * 128
    return 12 * batch * seq * layers * h * h * (
        (1 + groups / heads + seq / h) * ratio + model.intermediate_size / h * routed * 1.5 + vocab / (2 * layers * h)
    )


@pytest.mark.parametrize("name", ["Mixtral 8x7B, TP1 EP8 PP4 VP8", "Llama 2 7B, FSDP 8"])
def test_published_tflops_convert_with_the_publishers_flop_count(name):
    run = next(r for r in P.RUNS if r.name == name)
    model = run.model()
    per_token = megatron_flops(model, 1, run.seq) / run.seq
    assert P.noncausal_flops_per_token(model, run.seq) == pytest.approx(per_token, rel=1e-9)
