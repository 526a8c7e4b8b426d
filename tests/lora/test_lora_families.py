"""LoRA on every family: the adapted model's logits (adapters with random, non-zero B) equal the base
model's logits on weights merged by numpy (W + alpha/r · A·B by einsum over the stacked, input and
output dims), and every family's attention, MLP, expert and own matrices can be targeted. The base
without its adapters (`lora.base_of`, what a DPO reference model reads) is the base model."""

import string

import numpy as np
import pytest

from jaxpar import models
from jaxpar.models import lora
from tests.support import tiny

FAMILIES = {
    "llama": (tiny.llama, "q,k,v,o,gate,up,down"),
    "mixtral": (tiny.mixtral, "q,v,gate,up,down"),
    "qwen3": (tiny.qwen3, "q,k,v,o,gate,up,down"),
    "qwen3_moe": (tiny.qwen3_moe, "o,gate,down"),
    "qwen2_moe": (tiny.qwen2_moe, "q,k,v,gate,up,down,router"),
    "deepseek_v3": (tiny.deepseek_v3, "q_a,q_b,kv_a,kv_b,o,gate,up,down"),
    "gpt_oss": (tiny.gpt_oss, "q,k,v,o,gate,up,down,router"),
    "gemma3_text": (tiny.gemma3_text, "q,k,v,o,gate,up,down"),
}
# Every family's targetable names: its projections, never a norm or a bias.
NAMES = {
    "llama": "down,gate,k,o,q,up,v", "mixtral": "down,gate,k,o,q,router,up,v", "qwen3": "down,gate,k,o,q,up,v",
    "qwen3_moe": "down,gate,k,o,q,router,up,v", "qwen2_moe": "down,gate,k,o,q,router,shared_expert_gate,up,v",
    "deepseek_v3": "down,eh_proj,gate,kv_a,kv_b,o,q_a,q_b,router,up", "gpt_oss": "down,gate,k,o,q,router,up,v",
    "gemma3_text": "down,gate,k,o,q,up,v",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_target_names_are_the_projections(family):
    config = FAMILIES[family][0]()
    assert ",".join(lora.target_names(models.logical_axes(config.model))) == NAMES[family]
RANK, ALPHA = 4, 8.0


def _merged_by_numpy(params, logical):
    """The base params with each adapter pair folded by einsum (independent of `lora.delta`)."""
    out = lora.base_of(params)
    for path, a in lora.adapters_of(params).items():
        if not path[-1].endswith("_lora_a"):
            continue
        stem = path[-1][: -len("_lora_a")]
        b = params
        for k in path[:-1] + (stem + "_lora_b",):
            b = b[k]
        names = logical
        for k in path:
            names = names[k]
        batch, inputs = lora.split_dims(names)
        letters = iter(string.ascii_letters)
        lead = "".join(next(letters) for _ in range(batch))
        ins = "".join(next(letters) for _ in range(inputs))
        outs = "".join(next(letters) for _ in range(b.ndim - batch - 1))
        delta = np.einsum(f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}", np.asarray(a, np.float64), np.asarray(b, np.float64))
        holder = out
        for k in path[:-1]:
            holder = holder[k]
        holder[stem] = (np.asarray(holder[stem], np.float64) + ALPHA / RANK * delta).astype(np.float32)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_adapted_logits_equal_numpy_merged_weights(family):
    make, targets = FAMILIES[family]
    config = make(dict(lora=dict(rank=RANK, alpha=ALPHA, targets=targets)))
    adapted = lora.adapted(config.model, config.train.lora)
    params = _numpy(models.init_params(adapted, 0))
    rng = np.random.default_rng(1)
    for path in lora.adapters_of(params):
        if path[-1].endswith("_lora_b"):
            holder = params
            for k in path[:-1]:
                holder = holder[k]
            holder[path[-1]] = rng.normal(0, 0.05, holder[path[-1]].shape).astype(np.float32)
    assert {p[-1].rsplit("_lora_", 1)[0] for p in lora.adapters_of(params)} == set(targets.split(","))
    tokens = rng.integers(0, config.model.vocab_size, (2, 8))
    got = np.asarray(models.forward(adapted, params, tokens))
    want = np.asarray(models.forward(config.model, _merged_by_numpy(params, models.logical_axes(adapted)), tokens))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.max(np.abs(want)), rtol=0)
    base = np.asarray(models.forward(lora.base_config(adapted), lora.base_of(params), tokens))
    assert np.max(np.abs(got - base)) > 1e-3 * np.max(np.abs(base))  # the adapters do something


def _numpy(tree):
    return {k: _numpy(v) for k, v in tree.items()} if isinstance(tree, dict) else np.array(tree)
