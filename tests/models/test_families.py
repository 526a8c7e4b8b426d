"""The family records own their facts: each family's counts and FLOPs agree with the module it
builds, its record is consistent with itself, and no code outside a family's folder asks for a
family by name. Independent references: the parameter tree the module actually creates, and the
6·N·T + 6·L·T·S·D model-FLOP convention (6 FLOPs per parameter per token, plus causal attention)."""

from __future__ import annotations

import ast
import math

import jax
import numpy as np
import pytest

from jaxpar import models
from jaxpar.models.attention_pattern import layer_windows
from jaxpar.models.families import FAMILIES, facts
from tests.support import tiny
from tests.support.paths import REPO as ROOT

PACKAGE = ROOT / "jaxpar"
FAMILY_FOLDERS = {PACKAGE / "models" / name for name in FAMILIES}


# Beyond the tiny configs: the features that change the counts (dense layers among MoE layers,
# the loss-free router bias, a capacity, no q/k/v biases).
VARIANTS = {
    "qwen3_moe": dict(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2, router_bias_update_rate=1e-3),
    "qwen2_moe": dict(num_hidden_layers=3, mlp_only_layers=[1], qkv_bias=False, capacity_factor=1.0),
    # Queries projected directly, two shared experts, two prediction modules, every layer routed.
    "deepseek_v3": dict(q_lora_rank=None, n_shared_experts=2, num_nextn_predict_layers=2, first_k_dense_replace=0),
    # No attention biases, no sinks, every layer full, plain RoPE.
    "gpt_oss": dict(attention_bias=False, attention_sinks=False, sliding_window=None, layer_types=["full_attention"] * 2,
                    rope_scaling=dict(rope_type="default")),
}


def _configs():
    makes = (("llama", tiny.llama), ("mixtral", tiny.mixtral), ("qwen3", tiny.qwen3), ("qwen3_moe", tiny.qwen3_moe),
             ("qwen2_moe", tiny.qwen2_moe), ("deepseek_v3", tiny.deepseek_v3), ("gpt_oss", tiny.gpt_oss),
             ("gemma3_text", tiny.gemma3_text))
    for name, make in makes:
        model = make().model
        yield f"{name}-untied", model
        tied = model.copy_and_resolve_references()
        tied.tie_word_embeddings = True
        if "head_dim" in tied:
            tied.head_dim = 32  # heads x head_dim = 4 x hidden
        yield f"{name}-tied-hd32", tied
        if name in VARIANTS:
            yield f"{name}-variant", make(**VARIANTS[name]).model


CONFIGS = dict(_configs())


def _leaves(model):
    for path, leaf in jax.tree_util.tree_leaves_with_path(models.param_shapes(model)):
        yield [getattr(k, "key", str(k)) for k in path], math.prod(leaf.shape), leaf.ndim


def test_every_family_is_covered():
    assert {name.split("-")[0] for name in CONFIGS} == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_facts_count_the_parameters_the_module_builds(name):
    model = CONFIGS[name]
    f = facts(model)
    assert f.params_total == sum(size for _, size, _ in _leaves(model))
    # Active matmul parameters as the peer counts them: everything but the embedding lookup,
    # routed experts at k/E, a tied table once (it is the head's matmul).
    active = 0
    for keys, size, _ in _leaves(model):
        if keys[0] == "embed":
            active += size if model.tie_word_embeddings else 0
        elif "experts" in keys:
            active += size * f.moe.top_k // f.moe.experts
        else:
            active += size
    assert f.params_active == active
    assert f.is_moe == (FAMILIES[model.model_type].aux_losses is not None)
    assert f.vocab % 128 == 0 and f.vocab >= model.vocab_size


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_model_flops_follow_the_peer_convention(name):
    model = CONFIGS[name]
    f, batch, seq = facts(model), 4, 32
    tokens = batch * seq
    # A training step runs one more routed block per multi-token prediction depth (DeepSeek-V3's).
    blocks = model.num_hidden_layers + models.prediction_depth(model)
    attention = 6 * blocks * tokens * seq * model.num_attention_heads * f.head_dim
    # A sliding layer counts the pairs its window leaves visible (MaxText's convention for Gemma 3's
    # local layers), counted here on the mask: per query (pairs / S), 12·H·hd FLOPs each (3 × QKᵀ and PV).
    for window in layer_windows(model):
        if 0 < window < seq:
            i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
            pairs = int(((j <= i) & (i - j < window)).sum())
            attention += 12 * tokens * model.num_attention_heads * f.head_dim * (pairs / seq - seq / 2)
    assert f.model_flops_per_step(batch, seq) == pytest.approx(6 * f.params_active * tokens + attention)
    # The hardware FLOPs of a layer's matmuls: twice its active matmul weights per token (the
    # stacked weights of rank >= 3: no norm scales, q/k/v biases or router bias), plus attention over
    # every key; a mean over the layers when dense layers sit among MoE layers.
    matmul = 0
    for keys, size, ndim in _leaves(model):
        if keys[0] in ("layers", "dense_layers", "mtp") and ndim >= 3 and not keys[-1].endswith("bias"):
            matmul += size * f.moe.top_k // f.moe.experts if "experts" in keys else size
    per_layer = matmul / blocks
    assert f.layer_flops(seq) == pytest.approx(2 * per_layer + 4 * model.num_attention_heads * f.head_dim * seq)


def test_each_record_names_its_own_family():
    for name, record in FAMILIES.items():
        assert record.name == name
        assert record.schema().model_type == name
        assert record.module.__module__ == f"jaxpar.models.{name}"
        assert record.ranges(record.schema()) == []


def _names_a_family(node) -> bool:
    """A string literal, or a tuple / list / set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_names_a_family(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def model_type_comparisons(source: str) -> list[int]:
    """Lines comparing a `model_type` (attribute, key or name) with a string literal."""
    def is_model_type(node):
        return (
            (isinstance(node, ast.Attribute) and node.attr == "model_type")
            or (isinstance(node, ast.Name) and node.id == "model_type")
            or (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "model_type")
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "model_type")
        )

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_model_type(s) for s in sides) and any(_names_a_family(s) for s in sides):
                lines.append(node.lineno)
    return lines


def test_no_code_outside_a_family_folder_compares_model_type_to_a_name():
    assert model_type_comparisons('if config.model.model_type == "mixtral": pass') == [1]  # the checker sees one
    assert model_type_comparisons('x = cfg["model_type"] != "llama"') == [1]
    assert model_type_comparisons('x = cfg.get("model_type", "llama") in ("a",)') == [1]
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if any(folder in path.parents for folder in FAMILY_FOLDERS):
            continue
        if lines := model_type_comparisons(path.read_text()):
            found[str(path.relative_to(ROOT))] = lines
    assert not found


def test_the_plan_names_every_remat_policy_the_decoder_has():
    from jaxpar.models.decoder import REMAT_POLICIES
    from jaxpar.parallel.plan import REMAT_NAMES

    assert set(REMAT_POLICIES) == set(REMAT_NAMES)
