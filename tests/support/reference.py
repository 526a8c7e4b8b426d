"""Degeneracy helpers: run a config on some mesh through the production train step and compare the
run with the one-device run of the same config (the reversibility rule)."""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxpar.config import base_config
from jaxpar.train.setup import build
from tests.support.tiny import with_overrides

# Parameters after the last step (3 AdamW steps at lr 1e-2), about twice the worst measured over the
# degeneracy, MoE, pipeline and context suites: 2.6e-3 of a leaf's largest element, 2.5e-4 in norm (below).
# The elementwise bound is loose because Adam divides each gradient element by its own RMS: where a
# step-1 gradient is ~1e-8 (1e-6 of the leaf's largest), the 1e-7-relative fp32 differences of
# another layout's reduction order change that element's update by a good part of the learning rate.
# In norm, one such element can dominate a small leaf: Qwen3-MoE's v [2, 64, 2, 16] under data 2 x
# expert 2 x tensor 2, ZeRO-3, SP, capacity 1.0 (compiled as one LLVM module, tests/support/compile_flags.py):
# one element with a step-1 gradient of 1.6e-8 (1.2e-7 of the leaf's largest; 1.9e-8 on the mesh)
# ends 4.0e-4 away, 2.5e-4 of the leaf's norm; the next largest difference is 1.0e-5.
# A lost last update on one data shard of one leaf is 3.2e-2 and 3.7e-2 (tests/parallel/test_degeneracy.py).
PARAM_RTOL, PARAM_L2_RTOL = 5e-3, 5e-4

# Per-step metrics compared at every step, besides the loss.
COMPARED = ("grad_norm", "learning_rate", "loss_scale")


def synthetic_batches(config, steps: int, seed: int = 0, distinct_tokens: int = 16):
    """Random batches over a few token ids, so that three steps visibly lower the loss."""
    rng = np.random.default_rng(seed)
    shape = (config.train.global_batch_size, config.train.seq_len + 1)
    ids = rng.choice(config.model.vocab_size, distinct_tokens, replace=False)
    return [ids[rng.integers(0, distinct_tokens, shape)].astype(np.int32) for _ in range(steps)]


def packed_batches(config, steps: int, seed: int = 0, distinct_tokens: int = 16):
    """Packed documents [G, 2, S+1] (the document sources' batch): random documents of 2 .. S/2+1
    tokens (about three a row) over a few token ids, packed by the production packer (first fit, padding where no
    document fits), so segments and positions differ in every row and every step."""
    from tests.support.documents import packed_batch

    rng = np.random.default_rng(seed)
    rows, width = config.train.global_batch_size, config.train.seq_len + 1
    ids = rng.choice(config.model.vocab_size, distinct_tokens, replace=False)
    return [packed_batch([ids[rng.integers(0, distinct_tokens, n)] for n in rng.integers(2, width // 2 + 2, 4 * rows)], rows, width)
            for _ in range(steps)]


def run(config, batches, num_devices: int, init_params=None):
    """Initial params, step-1 gradients and every step's metrics, as numpy. One compile: the
    production step, returning its gradients too.

    `init_params` (natural order, e.g. the one-device reference's): start from them through
    `init_from_params`, whose compile costs a tenth of the initialiser's. That initialisation itself
    never depends on the mesh is proven once per sharding pattern (tests/models/test_init_independence.py)."""
    program = build(config, jax.devices()[:num_devices])
    state = program.init() if init_params is None else program.init_from_params(init_params)
    # Params in the natural [L] order (the state may hold the layers in the schedule's order).
    result = {"init_params": jax.device_get(program.to_natural(state).params), "losses": []} | {k + "s": [] for k in COMPARED}
    for step, batch in enumerate(batches):
        state, metrics, grads = program.step_with_grads(state, jax.device_put(batch, program.batch_sharding))
        if step == 0:
            result["grads1"] = jax.device_get(grads)
        metrics = jax.device_get(metrics)
        result["losses"].append(float(metrics["loss"]))
        for key in COMPARED:
            result[key + "s"].append(float(metrics[key]))
        if "expert_fraction" in metrics:
            result.setdefault("expert_fractions", []).append(np.asarray(metrics["expert_fraction"]))
        if "mtp_loss" in metrics:  # multi-token prediction, per depth
            result.setdefault("mtp_losses", []).append(np.asarray(metrics["mtp_loss"]))
    result["final_params"] = jax.device_get(program.to_natural(state).params)
    return {k: np.array(v) if isinstance(v, list) else v for k, v in result.items()}


def max_relative_error(tree, reference) -> float:
    """max over leaves of max|x - ref| / max|ref|."""
    errors = jax.tree.map(lambda x, r: float(np.max(np.abs(x - r)) / max(np.max(np.abs(r)), 1e-30)), tree, reference)
    return max(jax.tree.leaves(errors))


def l2_relative_error(tree, reference) -> float:
    """max over leaves of ||x - ref|| / ||ref||."""
    errors = jax.tree.map(lambda x, r: float(np.linalg.norm(x - r) / max(np.linalg.norm(r), 1e-30)), tree, reference)
    return max(jax.tree.leaves(errors))


def assert_matches_reference(result, reference, grad_rtol=1e-5, loss_rtol=1e-4, param_rtol=PARAM_RTOL, param_l2_rtol=PARAM_L2_RTOL):
    """Identical initial params; step-1 loss and gradients within `grad_rtol` (relative); every
    step's loss and gradient norm within `loss_rtol`; learning rates and loss scales equal; the
    parameters after the last step within `param_rtol` of each leaf's largest element and
    `param_l2_rtol` in norm."""
    for a, b in zip(jax.tree.leaves(result["init_params"]), jax.tree.leaves(reference["init_params"])):
        np.testing.assert_array_equal(a, b, err_msg="initial params differ from the reference's")
    assert abs(result["losses"][0] - reference["losses"][0]) <= grad_rtol * abs(reference["losses"][0])
    err = max_relative_error(result["grads1"], reference["grads1"])
    assert err <= grad_rtol, f"step-1 gradients differ from one device by {err:.2e} (relative)"
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=loss_rtol, err_msg="losses")
    np.testing.assert_allclose(result["grad_norms"], reference["grad_norms"], rtol=loss_rtol, err_msg="grad norms")
    np.testing.assert_allclose(result["learning_rates"], reference["learning_rates"], rtol=1e-6, err_msg="learning rates")
    np.testing.assert_array_equal(result["loss_scales"], reference["loss_scales"], err_msg="loss scales")
    err = max_relative_error(result["final_params"], reference["final_params"])
    l2 = l2_relative_error(result["final_params"], reference["final_params"])
    if os.environ.get("JAXPAR_PARAM_LOG"):  # measuring the tolerance
        with open(os.environ["JAXPAR_PARAM_LOG"], "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} {err:.2e} {l2:.2e}\n")
    assert err <= param_rtol, f"parameters after the last step differ from one device by {err:.2e} (relative)"
    assert l2 <= param_l2_rtol, f"parameters after the last step differ from one device by {l2:.2e} (relative, in norm)"


# The parallel keys that change one device's arithmetic: the attention kernel and its block size.
# The others (ZeRO, sequence parallelism, remat, pipeline and context options) degenerate to
# nothing there, so cases that differ only in them share one reference run.
ONE_DEVICE_KEYS = ("attention_impl", "context_block_size")


def single_device(cache, config, steps: int, batches=synthetic_batches):
    """The one-device run of `config` (mesh sizes ignored, the parallel section at its defaults
    but for `ONE_DEVICE_KEYS`) on `batches(config, steps)`, computed once per session."""
    one = with_overrides(config, {})
    one.parallel = base_config().parallel
    one.parallel.update({key: config.parallel[key] for key in ONE_DEVICE_KEYS})
    key = f"single:{one.to_json_best_effort()}:{steps}" + ("" if batches is synthetic_batches else f":{batches.__name__}")
    return cache.get(key, lambda: run(one, batches(one, steps), 1))
