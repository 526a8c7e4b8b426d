"""DPO on meshes against one device: two steps of `train.objective="dpo"` (the first with the policy
equal to its reference, the second not) give the same DPO loss, rewards, step-1 gradients and final
parameters on data 2 ZeRO-3 × tensor 2 with 2 microbatches (a dense Llama), on expert 2 (Mixtral,
its load-balancing loss added to the gradient pass), and with LoRA (the reference is the base
without adapters) on context 2 with load balancing (the per-rank gradient path and the permuted
sequence).
"""

import copy

import jax
import numpy as np
import pytest

from jaxpar.data.chat import Rendered
from jaxpar.data.formats import pair_document
from jaxpar.data.packing import ListStream, Packer
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.reference import PARAM_L2_RTOL, PARAM_RTOL, l2_relative_error, max_relative_error

ROWS, SEQ, STEPS = 4, 32, 2
METRICS = ("loss", "rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "grad_norm")


def preference_batches(vocab: int, seed: int = 0):
    """STEPS packed batches [ROWS, 3, SEQ+1] of random pairs (prompt 2-6 tokens, completions 2-6)."""
    rng = np.random.default_rng(seed)

    def half(prompt):
        completion = rng.integers(0, vocab, int(rng.integers(2, 7)))
        ids = np.concatenate([prompt, completion])
        return Rendered(ids.astype(np.int32), np.r_[np.zeros(len(prompt)), np.ones(len(completion))].astype(np.int32), (len(ids),))

    docs = []
    for _ in range(ROWS * STEPS * 3):
        prompt = rng.integers(0, vocab, int(rng.integers(2, 7)))
        docs.append(pair_document((half(prompt), half(prompt))))
    packer = Packer(ListStream(docs), ROWS, SEQ + 1)
    return [next(packer) for _ in range(STEPS)]


def dpo_config(config, **train):
    config = copy.deepcopy(config)
    config.train.update(global_batch_size=ROWS, seq_len=SEQ, objective="dpo", learning_rate=1e-2, **train)
    config.train.dpo.update(beta=0.5, label_smoothing=0.1)
    config.data.format = "preference"
    return config


def run(config, batches, devices: int, params=None):
    program = build(config, jax.devices()[:devices])
    state = program.init() if params is None else program.init_from_params(params)
    out = {"init": jax.device_get(program.to_natural(state).params), **{k: [] for k in METRICS}}
    for step, batch in enumerate(batches):
        state, metrics, grads = program.step_with_grads(state, jax.device_put(batch, program.batch_sharding))
        out["grads"] = jax.device_get(grads) if step == 0 else out["grads"]
        for key in METRICS:
            out[key].append(float(metrics[key]))
    out["final"] = jax.device_get(program.to_natural(state).params)
    return out


CASES = {
    "llama_data2_zero3_tensor2_accum2": (tiny.llama, {"data": 2, "tensor": 2}, {"zero_stage": 3}, {"grad_accum": 2}),
    "mixtral_expert2": (tiny.mixtral, {"expert": 2}, {}, {}),
    "llama_lora_context2": (tiny.llama, {"context": 2}, {}, {"lora": {"rank": 4, "alpha": 8.0}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_dpo_on_a_mesh_equals_one_device(case):
    make, mesh, parallel, train = CASES[case]
    train = dict(train)
    lora = train.pop("lora", {"rank": 0})
    single = dpo_config(make())
    single.train.lora.update(lora)
    config = dpo_config(single, **train)
    batches = preference_batches(config.model.vocab_size)
    one = run(single, batches, 1)
    many = run(tiny.with_overrides(config, mesh, parallel=parallel), batches, int(np.prod(list(mesh.values()))), params=one["init"])
    print(case, {k: (one[k], many[k]) for k in ("loss", "rewards_margin")})
    assert one["rewards_margin"][0] == 0 and one["rewards_margin"][1] != 0  # step 1: the policy is its reference
    for key in METRICS:
        np.testing.assert_allclose(many[key], one[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert max_relative_error(many["grads"], one["grads"]) <= 1e-4
    # Adam moves an element with a near-zero step-1 gradient by much of the learning rate (the project's
    # bounds for that: tests/support/reference.py).
    assert max_relative_error(many["final"], one["final"]) <= PARAM_RTOL
    assert l2_relative_error(many["final"], one["final"]) <= PARAM_L2_RTOL


def test_memory_model_prices_the_reference_copy():
    """The analytic memory model's parameter bytes under DPO: the params and the reference copy, as the
    built program's state holds them (data 4 × tensor 2, ZeRO-3); with LoRA no copy."""
    from jaxpar.analysis.cost.layout import Layout
    from jaxpar.analysis.cost.memory import estimate_memory
    from jaxpar.train.setup import bytes_per_device

    for lora in (0, 4):
        config = tiny.with_overrides(dpo_config(tiny.llama()), {"data": 4, "tensor": 2}, parallel={"zero_stage": 3})
        config.train.lora.update(rank=lora, alpha=8.0)
        program = build(config, jax.devices()[:8])
        state = jax.eval_shape(program.init)
        held = bytes_per_device(state.params, program.state_shardings.params)
        if not lora:
            held += bytes_per_device(state.reference, program.state_shardings.reference)
        assert (state.reference is None) == bool(lora)
        assert estimate_memory(Layout.from_config(config, 8)).params == held
