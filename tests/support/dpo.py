"""DPO runs for the mesh tests (`tests/train/test_dpo_meshes.py`, `test_dpo_pipeline.py`): random
preference pairs packed as the data pipeline packs them, a DPO config, and a few steps of the built
program with what the tests compare against one device."""

import copy

import jax
import numpy as np

from jaxpar.data.chat import Rendered
from jaxpar.data.formats import pair_document
from jaxpar.data.packing import ListStream, Packer
from jaxpar.train.setup import build

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
    """`config` set to train DPO (β 0.5, ε 0.1) on ROWS × SEQ preference batches; `train`: more train keys."""
    config = copy.deepcopy(config)
    config.train.update(global_batch_size=ROWS, seq_len=SEQ, objective="dpo", learning_rate=1e-2, **train)
    config.train.dpo.update(beta=0.5, label_smoothing=0.1)
    config.data.format = "preference"
    return config


def run(config, batches, devices: int, params=None):
    """Steps of the built program over `batches` on the first `devices` devices, from `params` (natural
    order) or its own init: the initial and final params, step 1's gradients and every step's METRICS."""
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
