"""jaxpar.interop.hf against transformers' DeepseekV3ForCausalLM: random tiny models (tests/support/hf_models.py
`DEEPSEEK_CASES`), and DeepSeek-V3's multi-token prediction layers in its own checkpoint layout.

Each case exercises MLA's features (queries through a latent or direct, YaRN with its softmax-scale
correction, interleaved RoPE pairs, value heads of another size than query heads) and its routing
(dense then routed layers, group-limited top-k, renormalised or not, scaled weights, one or two
shared experts, the selection bias). Logits are compared with transformers', and which experts
each token chose (transformers' router's own top-k indices, caught by a hook) with jaxpar's
per-expert shares; then saved from jaxpar and reloaded by transformers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxpar import models  # noqa: E402
from jaxpar.interop import hf  # noqa: E402
from jaxpar.models.deepseek_v3.schema import dense_layers  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.hf_models import DEEPSEEK_CASES, deepseek_model  # noqa: E402
from tests.support.hf_testing import assert_same_tree, max_err, tokens_for  # noqa: E402
from tests.support.tiers import slow_except  # noqa: E402


def hf_outputs(model, tokens):
    """(logits, the top-k expert indices of every routed layer's tokens) of a transformers model."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens)).logits
    for hook in hooks:
        hook.remove()
    return logits, chosen


@pytest.mark.parametrize("case", slow_except(sorted(DEEPSEEK_CASES), "q_lora_yarn_groups"))
def test_load_matches_hf_and_save_round_trips(case, tmp_path):
    model = deepseek_model(case)
    model.save_pretrained(tmp_path / "hf")
    tokens = tokens_for(model)
    expected, chosen = hf_outputs(model, tokens)

    cfg, params = hf.load(tmp_path / "hf")
    assert cfg.model_type == "deepseek_v3" and cfg.num_nextn_predict_layers == 0
    logits, aux = jax.jit(lambda p, t: models.apply(cfg, p, t))(params, jnp.asarray(tokens))
    logits = np.asarray(logits)[..., : cfg.vocab_size]
    err = max_err(logits, expected)
    print(f"{case}: jaxpar vs HF logits max abs {err:.2e}, |logits| max {np.abs(expected.numpy()).max():.1f}")
    assert err < 1e-4
    np.testing.assert_array_equal(logits, models.forward(cfg, params, tokens))

    # The same experts for every token of every routed layer (group limit, selection bias, top-k).
    assert len(chosen) == cfg.num_hidden_layers - len(dense_layers(cfg))
    indices = torch.cat(chosen).flatten()
    fraction = torch.bincount(indices, minlength=cfg.n_routed_experts).numpy() / indices.numel()
    _, metrics = models.aux_losses(cfg, aux)
    np.testing.assert_allclose(metrics["expert_fraction"], fraction, atol=1e-7)

    # Save from jax arrays, reload with transformers: same model, no missing or unexpected keys.
    hf.save(tmp_path / "out", cfg, jax.tree.map(jnp.asarray, params))
    reloaded, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info
    assert max_err(hf_outputs(reloaded.eval(), tokens)[0], expected) < 1e-5
    cfg2, params2 = hf.load(tmp_path / "out")
    assert cfg2 == cfg
    assert_same_tree(params2, params)


def random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), models.param_shapes(cfg))
    params["embed"]["weight"][cfg.vocab_size :] = 0
    params["lm_head"]["weight"][:, cfg.vocab_size :] = 0
    return params


def test_prediction_layers_round_trip_in_deepseek_layout(tmp_path):
    """Two MTP modules written as layers L and L + 1 (enorm, hnorm, eh_proj, a routed layer,
    shared_head.norm, and the embedding and head repeated as DeepSeek's weights hold them); transformers
    loads the main model and names exactly those layers unexpected; jaxpar reads them back bit-exact,
    refuses a repeated head that differs, and reads a checkpoint without them as a model without them."""
    cfg = tiny.deepseek_v3(num_nextn_predict_layers=2).model
    params = random_params(cfg)
    hf.save(tmp_path / "out", cfg, params)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    layers = cfg.num_hidden_layers
    for depth in range(2):
        prefix = f"model.layers.{layers + depth}."
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "self_attn.kv_b_proj.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.15.down_proj.weight"):
            assert prefix + name in tensors, prefix + name
        np.testing.assert_array_equal(tensors[prefix + "shared_head.head.weight"], tensors["lm_head.weight"])
        np.testing.assert_array_equal(tensors[prefix + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(tensors[f"model.layers.{layers}.eh_proj.weight"], params["mtp"]["eh_proj"][0].T)

    cfg2, params2 = hf.load(tmp_path / "out")
    assert hf.with_jaxpar_fields(cfg2, cfg) == cfg  # jaxpar's own loss coefficients are not in config.json
    assert_same_tree(params2, params)

    _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    unexpected = {name.split(".")[2] for name in info["unexpected_keys"]}
    assert unexpected == {str(layers), str(layers + 1)}, info["unexpected_keys"][:5]

    bad = dict(tensors)
    bad[f"model.layers.{layers + 1}.shared_head.head.weight"] = tensors["lm_head.weight"] + 1
    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((tmp_path / "out" / "config.json").read_text())
    with pytest.raises(ValueError, match="shared_head.head.weight differs from lm_head.weight"):
        hf.load(tmp_path / "bad")

    without = {k: v for k, v in tensors.items() if not k.startswith((f"model.layers.{layers}.", f"model.layers.{layers + 1}."))}
    (tmp_path / "main").mkdir()
    save_file(without, str(tmp_path / "main" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "main" / "config.json").write_text((tmp_path / "out" / "config.json").read_text())
    cfg3, params3 = hf.load(tmp_path / "main")
    assert cfg3.num_nextn_predict_layers == 0 and "mtp" not in params3
    assert_same_tree(params3, {k: v for k, v in params.items() if k != "mtp"})


def test_save_refuses_softmax_routing(tmp_path):
    cfg = tiny.deepseek_v3(scoring_func="softmax").model
    with pytest.raises(ValueError, match=r"^model.scoring_func='softmax' has no transformers equivalent"):
        hf.save(tmp_path / "out", cfg, random_params(cfg))
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(300)
def test_sharded_import_of_deepseek_layout_equals_whole_tensor_load(tmp_path):
    """`jaxpar.interop.sharded` reads MLA's per-head up-projections (q and k heads of 24, values of 16),
    the experts and the MTP layer straight onto a data 2 x expert 2 x tensor 2 mesh with ZeRO-3, block
    by block, bit-equal to `hf.load`; its preflight accepts the checkpoint for its own config and names
    the MTP layer a config asks for when the checkpoint lacks it."""
    from jaxpar.interop import sharded
    from jaxpar.train.setup import build

    cfg = tiny.deepseek_v3().model
    hf.save(tmp_path / "hf", cfg, random_params(cfg), max_shard_bytes=150_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    config = tiny.with_overrides(tiny.deepseek_v3(), {"data": 2, "expert": 2, "tensor": 2}, parallel={"zero_stage": 3})
    program = build(config)
    loaded = sharded.load_params_onto(str(tmp_path / "hf"), cfg, program.state_shardings.params)
    _, reference = hf.load(tmp_path / "hf")
    for (path, got), want, sharding in zip(
        jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(reference), jax.tree.leaves(program.state_shardings.params)
    ):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
        assert got.sharding == sharding
    assert sharded.problems(str(tmp_path / "hf"), cfg) == []
    deeper = tiny.deepseek_v3(num_nextn_predict_layers=2).model
    (problem,) = sharded.problems(str(tmp_path / "hf"), deeper)
    assert "model.num_nextn_predict_layers (checkpoint 1, config 2)" in problem
