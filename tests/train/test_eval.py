"""Held-out evaluation (`jaxpar.train.eval`): the eval loss is the mean over the eval set's real
targets, the same number on every mesh (data / tensor / gradient accumulation / context / the
pipeline's forward-only engine; Llama, and Mixtral with its experts split and inside pipeline
stages, whose eval is the cross-entropy alone) and packed or not — packing isolates documents, so a packed and an
unpacked eval of documents shorter than a row see the same targets through the same model. The
reference is written out here: every eval document run alone on one device, its token losses
summed, over the total target count. Through the training loop, evaluations land in metrics.jsonl
as their own records (every `eval.every_steps` and at the end, never twice for one step) while
training records stay one per step.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import models
from jaxpar.data.corpus import eval_stream
from jaxpar.parallel.tensor import cross_entropy
from jaxpar.train.eval import Evaluator
from jaxpar.train.loop import train
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.documents import make_tokenizer, texts, write_jsonl
from tests.support.tiers import slow_except

SEQ, ROWS = 32, 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    return {
        "tokenizer": make_tokenizer(root / "tokenizer"),
        "train": write_jsonl(root / "train.jsonl", texts(200, seed=1, low=2, high=20)),
        # Short documents (every one fits a row): packed and unpacked eval see the same targets.
        "eval": write_jsonl(root / "eval.jsonl", texts(37, seed=2, low=2, high=8)),
        "root": root,
    }


def _config(corpus, mesh=None, parallel=None, train_overrides=None, packing=True, family="llama", **evaluation):
    return tiny.with_overrides(
        getattr(tiny, family)({"global_batch_size": ROWS, "seq_len": SEQ, **(train_overrides or {})}, vocab_size=256),
        mesh or {},
        parallel=parallel or {},
        data={"source": "text", "path": corpus["train"], "tokenizer": corpus["tokenizer"], "packing": packing},
        eval={"path": corpus["eval"], **evaluation},
    )


def _reference(config):
    """(mean loss over every eval document's targets, their count), each document alone, one device."""
    docs = [d for d in eval_stream(config)]
    params = models.init_params(config.model, config.train.seed)
    width = max(len(d) for d in docs)
    rows = np.zeros((len(docs), width), np.int32)
    mask = np.zeros((len(docs), width - 1), np.float32)
    for i, d in enumerate(docs):
        rows[i, : len(d)], mask[i, : len(d) - 1] = d, 1
    logits, _ = models.apply(config.model, params, jnp.asarray(rows[:, :-1]))
    total = float(jnp.sum(cross_entropy(logits, jnp.asarray(rows[:, 1:])) * mask))
    return total / mask.sum(), int(mask.sum())


def _evaluate(config, devices):
    program = build(config, jax.devices()[:devices])
    return Evaluator(config, program).run(program.init().params, 0)


@pytest.fixture(scope="module")
def references(corpus):
    """family -> its per-document reference, computed on first use."""
    cache = {}
    return lambda family: cache.setdefault(family, _reference(_config(corpus, family=family)))


# name: (mesh, parallel, train overrides, packing[, family: llama])
MESHES = {
    "one_device_unpacked": ({}, {}, {}, False),
    "data2_tensor2_accum2": ({"data": 2, "tensor": 2}, {"sequence_parallel": True}, {"grad_accum": 2}, True),
    "c2_ring_balanced_data2": ({"context": 2, "data": 2}, {"context_impl": "ring", "context_load_balance": True}, {}, True),
    "pp2_1f1b_c2_data2": (
        {"pipeline": 2, "context": 2, "data": 2},
        {"pipeline_schedule": "1f1b", "num_microbatches": 4, "context_impl": "all_gather"}, {}, True,
    ),
    "pp2_gpipe_data2": ({"pipeline": 2, "data": 2}, {"pipeline_schedule": "gpipe", "num_microbatches": 2}, {}, True),
    # Mixtral (router losses on, dropless): eval is the cross-entropy alone, whatever the layout of its experts.
    "mixtral_one_device": ({}, {}, {}, True, "mixtral"),
    "mixtral_expert2_data2_tensor2_accum2": ({"expert": 2, "data": 2, "tensor": 2}, {}, {"grad_accum": 2}, True, "mixtral"),
    "mixtral_pp2_1f1b_expert2_data2": (
        {"pipeline": 2, "expert": 2, "data": 2}, {"pipeline_schedule": "1f1b", "num_microbatches": 2}, {}, True, "mixtral",
    ),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", slow_except(
    ["one_device_packed", *MESHES],
    "one_device_unpacked", "data2_tensor2_accum2", "mixtral_expert2_data2_tensor2_accum2", "mixtral_pp2_1f1b_expert2_data2",
))
def test_eval_loss_is_the_per_document_mean_on_every_mesh(name, corpus, references):
    mesh, parallel, train_overrides, packing, *family = MESHES.get(name, ({}, {}, {}, True))
    family = family[0] if family else "llama"
    config = _config(corpus, mesh, parallel, train_overrides, packing, family)
    assert family == "llama" or config.model.router_aux_loss_coef > 0  # eval must leave the aux losses out
    got = _evaluate(config, math.prod(mesh.values()) if mesh else 1)
    want_loss, want_tokens = references(family)
    assert got["eval_tokens"] == want_tokens
    assert abs(got["eval_loss"] - want_loss) <= 1e-5 * want_loss, (got, want_loss, want_tokens)
    assert got["eval_perplexity"] == pytest.approx(math.exp(got["eval_loss"]))


def test_eval_steps_limits_the_batches(corpus, references):
    got = _evaluate(_config(corpus, steps=1), 1)
    assert 0 < got["eval_tokens"] < references("llama")[1]


@pytest.mark.timeout(400)
def test_training_loop_logs_eval_records(corpus, tmp_path):
    config = _config(corpus, every_steps=2)
    config.train.steps = 3
    train(config, str(tmp_path / "run"), jax.devices()[:1], progress=False)
    with open(os.path.join(tmp_path / "run", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r["step"] for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert steps == [1, 2, 3]
    assert [r["step"] for r in evals] == [2, 3]
    assert all(set(r) == {"step", "eval_loss", "eval_perplexity", "eval_tokens"} for r in evals)
    assert evals[0]["eval_tokens"] == evals[1]["eval_tokens"] > 0
    assert all(np.isfinite(r["eval_loss"]) for r in evals)
