"""scripts/gpu_check.py's CPU path (issue 39 item 7), at the tiny size, held to what it must be whatever
the machine: tokens/s against tokens over step time; the model FLOPs against 6·N·T plus causal
attention counted here from the shapes; the fit check's bytes at least the parameters' and AdamW's;
every attention row within bf16's rounding of XLA in fp32, and `local_window_size` the same window as
the explicit mask (so that on a GPU a cuDNN difference is cuDNN's); the tables saying what the JSON
says; a spent budget skipping every section with its note."""

import json
import math

import jax
import numpy as np
import pytest

from jaxpar.bench import gpu_check
from jaxpar.models import param_shapes

# bf16 and the first FP8 recipe the schema offers (each recipe's numerics are tests/kernels' to prove).
PRECISIONS = ["bf16", *gpu_check.fp8_recipes(gpu_check.model_config("tiny"))[:1]]


@pytest.fixture(scope="module")
def result():
    return gpu_check.check("tiny", steps=1, budget_s=600, precisions=PRECISIONS, attention_repeats=1)


def test_step_rows_measure_what_they_say(result):
    config = gpu_check.model_config("tiny")
    m, batch, seq = config.model, config.train.global_batch_size, config.train.seq_len
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(param_shapes(m)))
    matmul_params = params - m.vocab_size * m.hidden_size  # the embedding is a lookup, not a matmul
    attention = 6 * m.num_hidden_layers * seq * m.hidden_size * batch * seq  # causal: half of 12·L·S·d per token
    assert [r["precision"] for r in result["step"]] == PRECISIONS
    for row in result["step"]:
        assert row["tokens_per_s"] == pytest.approx(batch * seq / row["step_s"], rel=1e-9)
        assert row["model_flops"] == pytest.approx(6 * matmul_params * batch * seq + attention, rel=1e-3)
        assert row["predicted_bytes"] >= 16 * params, "fp32 parameters and AdamW's two moments, at least"
        assert abs(row["loss"] - math.log(m.vocab_size)) < 0.2, "a fresh model predicts nearly uniformly"
        assert row["mfu"] is None, "no MFU against a CPU's nominal peak"
    assert result["step"][0]["measured_peak_bytes"] is None, "a CPU reports no allocator peak"
    planner = result["planner"]
    assert planner["measured_step_s"] == result["step"][0]["step_s"] and planner["predicted_step_s"] > 0


def test_attention_rows_are_within_bf16_of_xla_fp32(result):
    rows = {r["case"]: r for r in result["attention"]}
    window = gpu_check.model_config("tiny").train.seq_len // 8
    assert all(rows[name]["skipped"] == gpu_check.NOT_ON_CPU for name in rows if "cudnn" in name)
    measured = [r for r in rows.values() if "skipped" not in r]
    assert len(measured) == 4
    for row in measured:
        assert row["max_abs_error_vs_xla_fp32"] < 0.05 and row["fwd_bwd_s"] > 0, row  # bf16: 8 mantissa bits
    assert {f"window {window}, mask (the definition)", f"window {window}, xla local_window_size"} <= set(rows)


def test_the_window_is_the_one_the_definition_gives():
    """The rows' window call against a mask written here: query i sees keys i - W + 1 .. i."""
    q, k, v, _ = gpu_check._attention_inputs((1, 24, 2, 2, 8))
    window = 5
    i, j = np.arange(24)[:, None], np.arange(24)[None, :]
    scores = np.einsum("bqhd,bkhd->bhqk", np.asarray(q), np.asarray(k)) / math.sqrt(8)
    scores = np.where((j <= i) & (j > i - window), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), np.asarray(v))
    np.testing.assert_allclose(np.asarray(gpu_check.window_attention(q, k, v, window, "xla")), want, atol=2e-6)


def test_tables_and_json_say_the_same(result, tmp_path):
    json_path, md_path = gpu_check.write(result, str(tmp_path / "out"))
    assert json.load(open(json_path)) == json.loads(json.dumps(result))
    table = open(md_path).read()
    for row in result["step"]:
        assert f"| {row['precision']} | {row['step_s']:.4f} | {row['tokens_per_s']:.0f} |" in table
    for row in result["attention"]:
        assert f"| {row['case']} |" in table


def test_a_spent_budget_skips_every_section_with_its_note():
    out = gpu_check.check("tiny", steps=1, budget_s=1e-9, precisions=["bf16"])
    assert out["step"] == [{"precision": "bf16", "skipped": "time budget spent"}]
    assert out["planner"] == {"skipped": "no bf16 step measured"}
    assert {r.get("skipped") for r in out["attention"]} <= {"time budget spent", gpu_check.NOT_ON_CPU}
    assert "skipped: time budget spent" in gpu_check.markdown(out)
