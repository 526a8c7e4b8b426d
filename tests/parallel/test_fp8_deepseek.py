"""FP8 (`train.fp8`) on DeepSeek-V3: multi-head latent attention and the multi-token prediction projection.

- which matrices run in FP8: in the lowered forward and backward of one prediction module (`eh_proj`,
  then a block of MLA and the routed MLP), the dots on FP8 operands are exactly three (forward, dx,
  dw) per FP8 matrix: `eh_proj` (mtp_proj), MLA's q_a, q_b, kv_a, kv_b and o, the shared expert's
  gate, up and down — and none for the router (the routed experts run in the quantize-dequantize
  form, `jaxpar.kernels.fp8`, whose dots stay in the compute dtype);
- delayed scaling: after one backward each MLA matrix's history slot holds its own amaxes, the
  weight's being max |W| of that very matrix (a history index shared by two matrices, or a matrix
  left out, breaks it), the inputs of the down-projections max |x|;
- the planner prices MLA's cost parts at the FP8 peak when their matmuls run in FP8;
- FP8 DeepSeek-V3 with delayed scaling on context 2 (all_gather) x tensor 2 x expert 2 against FP8
  on one device, 3 production steps, within tests/parallel/test_fp8_degeneracy.py's tolerances
  but for the gradient norms' (below; measured in docs/fp8.md). One mesh holds every cut an FP8 matrix of MLA or MTP meets: heads over
  tensor, K and V gathered over context, the batch over context and expert; the recipes' other
  meshes are tests/parallel/test_fp8_degeneracy.py's.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import fp8
from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.cost_model import flops_by_part
from jaxpar.analysis.cost.efficiency import compute_seconds
from jaxpar.analysis.cost.layout import Layout
from jaxpar.command.config_file import load_config
from jaxpar.kernels.fp8 import OBSERVED
from jaxpar.models import deepseek_v3
from jaxpar.models.deepseek_v3 import rope
from jaxpar.models.deepseek_v3.attention import LatentAttention, fp8_matrices
from jaxpar.models.deepseek_v3.mtp import PredictionModule
from jaxpar.models.options import RunOptions
from tests.support import tiny
from tests.support.paths import REPO
from tests.support.reference import l2_relative_error, run, single_device, synthetic_batches

# tests/parallel/test_fp8_degeneracy.py's steps and bounds (its docstring says why they are these).
STEPS = 3
GRAD_L2_RTOL, LOSS_RTOL = 2e-3, 1e-3
# Gradient norms of steps 2-3, which delayed scaling takes from the amax histories: one element that
# rounds to the other FP8 neighbour and holds its tensor's amax moves that tensor's scale, and the
# norm with it. Measured 7.7e-4 on one host and 1.07e-3 on another (fp32 noise decides which
# elements flip); a wrong scale moves it by >= 1e-2 (test_fp8_degeneracy.py).
GRAD_NORM_RTOL = 3e-3
F8_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<([0-9x]+)xf8E\w+>, tensor<([0-9x]+)xf8E\w+>\)")


def _setup(recipe: str, module):
    # q_lora_rank 40: every FP8 matrix of a prediction module has a shape of its own (checked below by shape).
    config = tiny.deepseek_v3({"fp8": recipe, "fp8_amax_history": 2}, q_lora_rank=40)
    cfg = fp8.with_state(config.model, config.train)
    opts = RunOptions(fp8=fp8.from_config(config.train))
    with nnx.use_eager_sharding(False):
        return cfg, opts, module(cfg)


def _inputs(cfg, batch=2, seq=8):
    x = jax.random.normal(jax.random.key(1), (batch, seq, cfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    return x, positions, rope.inverse_frequencies(cfg)


def _prediction_module(cfg):
    return PredictionModule(cfg, rngs=nnx.Rngs(0), make_attention=LatentAttention, make_mlp=deepseek_v3.DeepseekV3.make_mlp)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_every_mla_and_mtp_matrix_runs_in_fp8(recipe):
    cfg, opts, module = _setup(recipe, _prediction_module)
    graph, state = nnx.split(module)
    x, positions, inv_freq = _inputs(cfg)

    def loss(state, h, embedded):
        out, _ = nnx.merge(graph, state)(h, embedded, positions, inv_freq, opts)
        return jnp.sum(out * out)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x, 0.5 * x).as_text()
    shapes = [(a, b) for a, b in F8_DOT.findall(text)]
    attention, shared = module.block.attention, module.block.mlp.shared_expert
    weights = {"eh_proj": module.eh_proj, **{m: getattr(attention, m) for m in fp8_matrices(cfg)},
               **{m: getattr(shared, m) for m in ("gate", "up", "down")}}
    assert len(shapes) == 3 * len(weights), f"{len(shapes)} FP8 dots, not 3 per matrix of {list(weights)}"
    dims = {name: "x".join(map(str, w.shape)) for name, w in weights.items()}  # gate and up share one
    for name, shape in dims.items():
        expected = 2 * list(dims.values()).count(shape)  # its forward and dx
        assert sum(shape in pair for pair in shapes) == expected, f"{name} {shape}: not an FP8 operand of its forward and dx"
    router = "x".join(map(str, module.block.mlp.router.shape))
    assert all(router not in pair for pair in shapes)


def test_delayed_histories_hold_each_mla_matrix_amaxes():
    cfg, opts, attention = _setup("delayed", lambda cfg: LatentAttention(cfg, rngs=nnx.Rngs(0)))
    graph, state = nnx.split(attention)
    x, positions, inv_freq = _inputs(cfg)

    def loss(state):
        return jnp.sum(nnx.merge(graph, state)(x, positions, inv_freq, opts) ** 2)

    grads = jax.jit(jax.grad(loss))(state)
    observed = np.asarray(grads["fp8_history"][...])[:, OBSERVED]  # [matrices, (x, w, dy)]
    matrices = fp8_matrices(cfg)
    assert observed.shape == (len(matrices), 3)
    for i, name in enumerate(matrices):
        np.testing.assert_allclose(observed[i, 1], np.max(np.abs(getattr(attention, name)[...])), rtol=1e-6, err_msg=name)
    for name in ("q_a", "kv_a"):  # the down-projections read the block's input
        np.testing.assert_allclose(observed[matrices.index(name), 0], np.max(np.abs(x)), rtol=1e-6, err_msg=name)
    assert np.all(observed > 0)


# The matmuls this family adds to FP8: MLA's (by the names of layers.Attention's) and the prediction
# modules' eh_proj. The experts stay in the compute dtype here: with them in FP8 (tensorwise) this
# tiny model's step 1 sits on a rounding tie, and one device against itself with the parameters
# moved by one ulp differs by 1.9e-2, as much as data 8 does (docs/fp8.md): no mesh bug to guard.
MLA_AND_MTP = "q_proj,k_proj,v_proj,o_proj,mtp_proj"


# name: (recipe, mesh, parallel). Delayed: step 1 scales from the tensors in hand (as tensorwise:
# measured the same 4.0e-7 gradients), steps 2 and 3 from the histories, sharded and updated like
# the layers' (layers.Attention). Context all_gather with kv_b in FP8 gathers K and V, not the
# latents (jaxpar.models.deepseek_v3.attention). Slow: a DeepSeek-V3 compile per mesh (~25 CPU s); the
# two meshes this replaced (delayed over data 2 x tensor 2 x expert 2, tensorwise over context 2 x
# tensor 2 x data 2) are measured in docs/fp8.md.
CASES = {
    "delayed_context2_tensor2_expert2_all_gather": (
        "delayed", {"context": 2, "tensor": 2, "expert": 2}, {"context_impl": "all_gather"},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_fp8_deepseek_matches_single_device(name, shared_cache):
    recipe, mesh, parallel = CASES[name]
    one = tiny.deepseek_v3({"fp8": recipe, "fp8_matmuls": MLA_AND_MTP})
    reference = single_device(shared_cache, one, STEPS)
    config = tiny.with_overrides(one, mesh, parallel=parallel)
    result = run(config, synthetic_batches(config, STEPS), 8, reference["init_params"])
    err = l2_relative_error(result["grads1"], reference["grads1"])
    assert err <= GRAD_L2_RTOL, f"step-1 gradients differ from one device by {err:.2e} in norm"
    for key, bound in (("losses", LOSS_RTOL), ("grad_norms", GRAD_NORM_RTOL)):
        gap = abs(result[key] - reference[key]) / abs(reference[key])
        assert gap.max() <= bound, f"{key} differ from one device by {gap.max():.2e}"


def test_the_planner_prices_mla_parts_at_the_fp8_peak():
    """The cost model's MLA parts ("qo": q_b and o; "kv": kv_b; "latent": q_a, kv_a, eh_proj) move to
    the FP8 peak with their matmuls (`jaxpar.fp8.COST_PARTS`), attention and the head do not."""
    config = load_config(os.path.join(REPO, "configs", "deepseek_v3_16b.py"))
    config.train.compute_dtype = "bfloat16"
    h100 = hw.get("h100-80g")

    def seconds(**train):
        c = config.copy_and_resolve_references()
        c.train.update(train)
        layout = Layout.from_config(c, num_devices=8)
        return compute_seconds(layout, flops_by_part(layout), h100).by_part

    bf16, fp8_all = seconds(), seconds(fp8="tensorwise")
    for part in ("qo", "kv", "latent"):
        assert fp8_all[part] < bf16[part], part
    for part in ("attention", "head", "router"):
        assert fp8_all[part] == bf16[part], part
    without_mtp = seconds(fp8="tensorwise", fp8_matmuls="q_proj,k_proj,v_proj,o_proj")
    assert without_mtp["latent"] == bf16["latent"] and without_mtp["qo"] == fp8_all["qo"]
    # Context all_gather moves the latents, but K and V with kv_b in FP8 (jaxpar.parallel.context.plan).
    config.mesh.update(data=-1, context=2)
    config.parallel.context_impl = "all_gather"
    for train, latent in (({}, True), ({"fp8": "delayed"}, False), ({"fp8": "delayed", "fp8_matmuls": "q_proj"}, True)):
        c = config.copy_and_resolve_references()
        c.train.update(train)
        assert Layout.from_config(c, num_devices=8).context_latent is latent, train
