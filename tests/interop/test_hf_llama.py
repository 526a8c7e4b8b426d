"""jaxpar.interop.hf against transformers' LlamaForCausalLM: random tiny models, logits compared.

Weights are drawn with a large std and norm weights away from 1, so a swapped or mis-laid-out
tensor moves the logits by far more than the tolerance.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxpar import models  # noqa: E402
from jaxpar.interop import hf  # noqa: E402
from tests.support.hf_models import LLAMA_CASES, llama_model  # noqa: E402
from tests.support.hf_testing import assert_same_tree, max_err, tokens_for  # noqa: E402


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_load_matches_hf_and_save_round_trips(case, tmp_path):
    model = llama_model(case)
    model.save_pretrained(tmp_path / "hf")
    tokens = tokens_for(model)
    expected = hf_logits(model, tokens)

    cfg, params = hf.load(tmp_path / "hf")
    assert cfg.vocab_size == model.config.vocab_size
    assert cfg.rope_scaling.rope_type == model.config.rope_parameters["rope_type"]
    logits = np.asarray(models.forward(cfg, params, tokens))
    print(f"{case}: jaxpar vs HF max abs {max_err(logits, expected):.2e}, |logits| max {np.abs(expected).max():.1f}")
    assert logits.shape == expected.shape
    assert max_err(logits, expected) < 1e-4

    # Padded vocab rows / columns stay zero.
    assert not params["embed"]["weight"][cfg.vocab_size :].any()

    # Save from jax arrays, reload with transformers: same model, no missing or unexpected keys.
    hf.save(tmp_path / "out", cfg, jax.tree.map(jnp.asarray, params))
    reloaded, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info
    round_trip = hf_logits(reloaded.eval(), tokens)
    print(f"{case}: saved vs original HF max abs {max_err(round_trip, expected):.2e}")
    assert max_err(round_trip, expected) < 1e-5

    # And our own reader gets back exactly what it wrote.
    cfg2, params2 = hf.load(tmp_path / "out")
    assert cfg2 == cfg
    assert_same_tree(params2, params)


@pytest.mark.parametrize("case", ["gqa_untied", "mqa_tied"])
def test_training_loss_equals_transformers_labels_loss(case, tmp_path):
    """An independent oracle for the cross-entropy itself (vocab padding masked, shift by one,
    mean over tokens): transformers' `labels=` loss on the same weights."""
    from jaxpar.train.loss import model_loss

    model = llama_model(case)
    model.save_pretrained(tmp_path)
    rows = np.random.default_rng(1).integers(0, model.config.vocab_size, (3, 20))
    with torch.no_grad():
        expected = float(model(torch.as_tensor(rows), labels=torch.as_tensor(rows)).loss)
    cfg, params = hf.load(tmp_path)
    loss = jax.jit(lambda p, r: model_loss(p, r, None, model_config=cfg, opts=models.RunOptions(), scale=1.0)[0])(
        params, jnp.asarray(rows)
    )
    print(f"{case}: jaxpar loss {float(loss):.6f}, transformers {expected:.6f}")
    assert abs(float(loss) - expected) <= 1e-5 * abs(expected)
    assert expected > 1.0  # a random model: far from a trivially small loss


def rewrite_config(directory, edit):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize(
    "case, legacy_key", [("llama3_head_dim", "rope_type"), ("llama3_head_dim", "type"), ("gqa_untied", None)]
)
def test_top_level_rope_layout_loads_identically(case, legacy_key, tmp_path):
    """Real Llama 3.x config.json: top-level rope_theta + rope_scaling (null for default rope)."""
    llama_model(case).save_pretrained(tmp_path)
    cfg, params = hf.load(tmp_path)

    def to_legacy(config):
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        if legacy_key is None:
            config["rope_scaling"] = None
        else:
            rope[legacy_key] = rope.pop("rope_type")
            config["rope_scaling"] = rope

    rewrite_config(tmp_path, to_legacy)
    legacy_cfg, legacy_params = hf.load(tmp_path)
    assert legacy_cfg == cfg
    assert_same_tree(legacy_params, params)


def test_sharded_checkpoint_loads(tmp_path):
    model = llama_model("gqa_untied")
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    cfg, params = hf.load(tmp_path / "single")
    sharded_cfg, sharded_params = hf.load(tmp_path / "sharded")
    assert sharded_cfg == cfg
    assert_same_tree(sharded_params, params)


def test_bfloat16_checkpoint_loads(tmp_path):
    model = llama_model("mqa_tied", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    _, params = hf.load(tmp_path)
    embed = model.model.embed_tokens.weight.float().detach().numpy()
    assert params["embed"]["weight"].dtype == np.float32
    np.testing.assert_array_equal(params["embed"]["weight"][: embed.shape[0]], embed)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.load(tmp_path / "nope")


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda d: os.remove(d / "config.json"), FileNotFoundError, "no config.json"),
        (lambda d: os.remove(d / "model.safetensors"), FileNotFoundError, "no model.safetensors"),
        (lambda d: rewrite_config(d, lambda c: c.update(model_type="gpt2")), ValueError, "model_type 'gpt2'"),
        (
            lambda d: rewrite_config(d, lambda c: c.update(rope_parameters=dict(rope_type="yarn", factor=2.0))),
            ValueError,
            "rope_type 'yarn' is not supported",
        ),
        (lambda d: rewrite_config(d, lambda c: c.update(num_key_value_heads=3)), ValueError, "fit the model config"),
    ],
    ids=["no_config", "no_weights", "model_type", "rope_type", "wrong_heads"],
)
def test_clear_errors(edit, error, match, tmp_path):
    llama_model("gqa_untied").save_pretrained(tmp_path)
    edit(tmp_path)
    with pytest.raises(error, match=match):
        hf.load(tmp_path)
