"""Mixtral under expert parallelism trains exactly like one device (the reversibility rule).

Each case runs 3 fp32 steps (dropless, nonzero load-balancing and z-loss coefficients) and is
compared with the same config on one device: identical initial params, step-1 loss and gradients
within 1e-5 relative, losses within 1e-4. Capacity is per sequence, so even dropping configs are
mesh-invariant; with a large factor nothing drops and the result equals dropless.
"""

import math

import jax
import numpy as np
import pytest

from jaxpar import models
from jaxpar.config import base_config, mixtral_model_config
from tests.reference import assert_matches_reference, run, synthetic_batches, with_overrides

STEPS = 3


def tiny_config(**model):
    c = base_config()
    c.model = mixtral_model_config(
        vocab_size=250,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.05,
        router_z_loss_coef=0.01,
        **model,
    )
    c.train.update(global_batch_size=16, seq_len=16, steps=STEPS, learning_rate=1e-2, warmup_steps=0)
    return c


def run_on(config, mesh, parallel=None, **model):
    config = with_overrides(config, mesh, parallel=parallel or {}, model=model)
    return run(config, synthetic_batches(config, STEPS), num_devices=math.prod(mesh.values()) if mesh else 1)


# Together: expert 2, 4 and 8; expert × data; expert × tensor; expert × data × tensor (+ ZeRO-3, SP).
# "expert4_capacity8": a capacity factor of 8 gives every expert room for the whole sequence, so
# nothing drops and capacity mode must equal the dropless reference.
CASES = {
    "expert2_data4": ({"data": 4, "expert": 2}, {}, {}),
    "expert4_capacity8": ({"expert": 4}, {}, {"capacity_factor": 8.0}),
    "expert8": ({"expert": 8}, {}, {}),
    "expert4_tensor2": ({"expert": 4, "tensor": 2}, {}, {}),
    "data2_expert2_tensor2_zero3_sp": (
        {"data": 2, "expert": 2, "tensor": 2},
        {"zero_stage": 3, "sequence_parallel": True},
        {},
    ),
}


@pytest.fixture(scope="module")
def reference():
    return run_on(tiny_config(), {})


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(name, reference):
    mesh, parallel, model = CASES[name]
    assert_matches_reference(run_on(tiny_config(), mesh, parallel, **model), reference)


def test_reference_actually_trains(reference):
    assert reference["losses"][-1] < reference["losses"][0] - 0.05


def router_metrics(config, batch):
    logits_aux = jax.jit(lambda p, t: models.apply(config.model, p, t)[1])
    aux = logits_aux(models.init_params(config.model, config.train.seed), batch[:, :-1])
    return jax.device_get(models.aux_losses(config.model, aux)[1])


def test_small_capacity_drops_tokens_the_same_on_any_mesh(reference):
    config = tiny_config(capacity_factor=0.5)
    metrics = router_metrics(config, synthetic_batches(config, 1)[0])
    assert metrics["dropped_fraction"] > 0.1
    np.testing.assert_allclose(metrics["expert_fraction"].sum(), 1.0, rtol=1e-6)

    single = run_on(config, {})
    assert abs(single["loss1"] - reference["loss1"]) > 1e-4, "dropping tokens should change the loss"
    assert_matches_reference(run_on(config, {"data": 2, "expert": 4}), single)


def test_grad_accumulation_keeps_router_losses_mesh_invariant():
    # Load-balancing statistics are per microbatch under accumulation; the microbatches are the same
    # rows on every mesh, so expert × data with grad_accum 2 must still equal one device.
    config = with_overrides(tiny_config(), {}, train={"grad_accum": 2})
    single = run_on(config, {})
    assert_matches_reference(run_on(config, {"data": 2, "expert": 4}), single)
