"""The cost model prices `train.fp8`'s matmuls at the FP8 peak (H100: 1,979 TFLOP/s dense, twice bf16's) times an FP8 efficiency.

Closed form: a compute-bound part's seconds are flops / (η · peak) plus a fixed time per kernel
(`jaxpar.analysis.cost.efficiency`, rule 1), an FP8 GEMM's η times `Hardware.fp8_efficiency` r, so moving
a part from bf16 to FP8 saves exactly flops / (η · P_bf16) · (1 − P_bf16 / (r · P_fp8)) = 1 − 1 / 2r of
its bf16 compute time on H100 (half at r = 1); the kernel times cancel. Parts that never run in FP8
(attention, the LM head) cost the same; a profile with no FP8 peak (A100) prices FP8 runs as bf16
ones; `train.fp8_matmuls` decides which parts move.
"""

import os

import pytest

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.cost_model import flops_by_part
from jaxpar.analysis.cost.efficiency import compute_seconds
from jaxpar.analysis.cost.layout import Layout
from jaxpar.command.config_file import load_config
from tests.support.paths import REPO


@pytest.fixture(scope="module")
def llama8b():
    config = load_config(os.path.join(REPO, "configs", "llama3_8b.py"))
    config.train.compute_dtype = "bfloat16"
    return config


def _seconds(config, hardware, **train):
    c = config.copy_and_resolve_references()
    c.train.update(train)
    layout = Layout.from_config(c, num_devices=8)
    flops = flops_by_part(layout)
    return compute_seconds(layout, flops, hardware).by_part, flops


def test_fp8_parts_save_the_closed_form_share_of_their_bf16_compute_on_h100(llama8b):
    h100 = hw.get("h100-80g")
    bf16, flops = _seconds(llama8b, h100)
    fp8, _ = _seconds(llama8b, h100, fp8="tensorwise")
    for part in ("qo", "kv", "mlp"):
        eta = h100.matmul_efficiency
        saved = flops[part] / (eta * h100.peak("bfloat16")) - flops[part] / (eta * h100.fp8_efficiency * h100.peak("float8"))
        assert saved == pytest.approx(flops[part] / (eta * 989.5e12) * (1 - 1 / (2 * h100.fp8_efficiency)), rel=1e-9)
        assert bf16[part] - fp8[part] == pytest.approx(saved, rel=1e-9), part
    for part in ("attention", "head"):
        assert fp8[part] == bf16[part], part


def test_only_the_listed_matmuls_move_and_only_where_fp8_exists(llama8b):
    h100, a100 = hw.get("h100-80g"), hw.get("a100-80g")
    bf16, _ = _seconds(llama8b, h100)
    mlp_only, _ = _seconds(llama8b, h100, fp8="rowwise", fp8_matmuls="mlp_gate,mlp_up,mlp_down")
    assert mlp_only["mlp"] < bf16["mlp"] and mlp_only["qo"] == bf16["qo"] and mlp_only["kv"] == bf16["kv"]
    # q_proj without o_proj: the "qo" part is not all FP8, priced as bf16.
    half, _ = _seconds(llama8b, h100, fp8="delayed", fp8_matmuls="q_proj")
    assert half == bf16
    assert _seconds(llama8b, a100, fp8="tensorwise")[0] == _seconds(llama8b, a100)[0]


def test_delayed_scaling_state_is_in_the_memory_model(llama8b):
    """Its amax histories are parameters to the memory model: per layer (4 attention + 3 MLP matmuls)
    × (H + 1) × 3 fp32 values, and as model state the optimizer holds moments for them too."""
    from jaxpar.analysis.cost.memory import param_counts

    def counts(**train):
        c = llama8b.copy_and_resolve_references()
        c.train.update(train)
        return param_counts(Layout.from_config(c, num_devices=8))

    plain, delayed = counts(), counts(fp8="delayed", fp8_amax_history=16)
    layers = llama8b.model.num_hidden_layers
    assert delayed.total - plain.total == layers * 7 * 17 * 3
    assert counts(fp8="tensorwise").total == plain.total  # current scaling keeps no state
