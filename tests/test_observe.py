"""Observability: honest step timing, MFU, TensorBoard scalars, profiles read back per named scope.

References: the profile breakdown of a function whose two scopes do known amounts of matmul work
(their times must order like their FLOPs); TensorBoard event files decoded independently of
tensorboardX's writer (TFRecord framing + the Event proto); compile time against an explicit AOT
compile of the same step.
"""

import glob
import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis import hlo, profile
from jaxpar.train import observe
from tests import tiny


def test_op_names_read_from_hlo_map_to_scopes():
    text = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}
ENTRY %main.5 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ynn_fusion.2 = f32[4]{0} fusion(%p), kind=kCustom, calls=%f, metadata={op_name="jit(f)/transpose(jvp(mlp))/dot_general" stack_frame_id=3}
}"""
    assert profile.scope_of(hlo.instructions(text)["ynn_fusion.2"].op_name) == ("mlp", "backward")


@pytest.mark.parametrize(
    "op_name, expected",
    [
        ("jit(step)/jvp()/while/body/closed_call/attention/vmap()/exp", ("attention", "forward")),
        ("jit(step)/transpose(jvp())/while/body/closed_call/mlp/dot_general", ("mlp", "backward")),
        ("jit(step)/transpose(jvp())/while/body/closed_call/(attention/bsd:attention/x)", ("attention", "backward")),
        ("jit(step)/optimizer_update/add", ("optimizer_update", "forward")),
        ("jit(step)/jvp()/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice", ("layer_scan", "forward")),
        ("jit(step)/jvp()/broadcast_in_dim", ("other", "forward")),
        ("", ("unscoped", "forward")),
    ],
)
def test_scope_of(op_name, expected):
    assert profile.scope_of(op_name) == expected


def test_shared_times_split_overlaps_evenly():
    # [0, 100) alone for 10, shared with [10, 30) for 20, alone until 40, shared with [40, 100)
    # for 60; [100, 105) after. The shares add up to the busy time (105), never more.
    shares = profile._shared_times([(0, 100), (10, 30), (40, 100), (100, 105)])
    assert shares == [10 + 10 + 10 + 30, 10, 30, 5]
    assert sum(shares) == 105


@pytest.mark.timeout(300)
def test_profile_breakdown_follows_flops(tmp_path):
    """Two scopes, one doing 8× the matmul FLOPs of the other: the breakdown must attribute
    the time accordingly (positive control for the op → scope join)."""
    x = jnp.ones((512, 512), jnp.float32)

    @jax.jit
    def f(a):
        with jax.named_scope("attention"):
            big = a
            for _ in range(8):
                big = jnp.tanh(big @ a)
        with jax.named_scope("mlp"):
            small = jnp.tanh(big @ a)
        return small

    f(x).block_until_ready()
    folder = str(tmp_path / "profile")
    jax.profiler.start_trace(folder)
    for step in range(3):
        with jax.profiler.StepTraceAnnotation(observe.STEP_ANNOTATION, step_num=step):
            f(x).block_until_ready()
    jax.profiler.stop_trace()
    observe.save_step_hlo(folder, f.lower(x).compile())
    trace = profile.load(folder)
    assert len(trace.step_ns) == 3
    scopes, collectives, total = profile.breakdown(trace, module_filter="jit_f")
    by_name = {row.name: row.ns for row in scopes}
    assert not collectives
    assert abs(sum(by_name.values()) - total) < 1e-6 * total
    assert by_name["attention"] > 3 * by_name["mlp"] > 0
    assert by_name["attention"] + by_name["mlp"] > 0.8 * total
    assert "attention" in profile.format_report(trace)


def test_peak_flops_sources():
    class Device:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    assert observe.peak_flops_per_device(Device(), "bfloat16") == (989e12, "table (H100, 16-bit)")
    assert observe.peak_flops_per_device(Device(), "float32", override=5.0)[0] == 5.0
    Device.device_kind = "Mystery accelerator"
    assert observe.peak_flops_per_device(Device(), "float32")[0] == 0.0
    cpu_peak, source = observe.peak_flops_per_device(jax.devices("cpu")[0], "float32")
    # A 2-core host reaches ~1e11 FLOP/s on a big matmul; 8 emulated devices share it.
    assert 1e8 < cpu_peak < 1e13 and "measured" in source


def test_observability_checks_name_keys():
    config = tiny.llama({"profile_steps": -1, "peak_flops_per_device": -1.0})
    assert [e.split("=")[0] for e in observe.checks(config)] == ["train.profile_steps", "train.peak_flops_per_device"]
    config = tiny.llama({"profile_steps": 2, "profile_start": 0})
    assert observe.checks(config)[0].startswith("train.profile_start=0")


def _tensorboard_scalars(folder) -> dict:
    """{tag: {step: value}} decoded from TFRecord-framed Event protos (not via tensorboardX)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in glob.glob(os.path.join(folder, "events.out.tfevents.*")):
        data = open(path, "rb").read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


@pytest.mark.timeout(300)
def test_training_run_writes_timing_tensorboard_and_profile(tmp_path):
    from jaxpar.train.loop import train

    config = tiny.mixtral({"steps": 4, "profile_start": 2, "profile_steps": 2}, vocab_size=256)
    config.data.max_corpus_bytes = 100_000
    config.mesh.data = 2
    history = train(config, str(tmp_path), devices=jax.devices()[:2], progress=False)

    # Compile time is its own field, on the first step only; step time excludes it.
    assert history[0]["compile_s"] > 0.5 and all("compile_s" not in r for r in history[1:])
    assert history[0]["step_s"] < history[0]["compile_s"]
    for record in history:
        assert record["tokens_per_sec"] == pytest.approx(16 * 16 / record["step_s"])
        assert 0 < record["mfu"] < 1

    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    for tag in ("loss", "grad_norm", "learning_rate", "tokens_per_sec", "mfu", "step_s"):
        assert sorted(scalars[tag]) == [1, 2, 3, 4], tag
    assert scalars["loss"][3] == pytest.approx(history[2]["loss"], rel=1e-6)
    experts = [scalars[f"expert_fraction/{e}"][4] for e in range(8)]  # MoE router statistics
    np.testing.assert_allclose(experts, history[3]["expert_fraction"], rtol=1e-6)
    assert sum(experts) == pytest.approx(1.0, rel=1e-5)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["compile_s"] == history[0]["compile_s"]

    trace = profile.load(str(tmp_path / "profile"))
    assert len(trace.step_ns) == 2 and trace.devices == 2
    scopes, collectives, total = profile.breakdown(trace)
    names = {row.name for row in scopes}
    assert {"attention", "moe_router", "lm_head", "loss", "optimizer_update"} <= names
    assert collectives and collectives[0].name == "all-reduce"  # the data-parallel gradient reduction
