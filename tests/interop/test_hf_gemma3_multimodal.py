"""Gemma 3's released checkpoints are multimodal (Gemma3ForConditionalGeneration, model_type gemma3):
jaxpar reads their text model as gemma3_text and leaves the vision tower and the projector, saying
so in one line on stderr.

The model is tests/support/gemma3_hf.py's random tiny Gemma 3 (layers sliding / full / sliding,
window 4, two RoPE bases) inside Gemma3ForConditionalGeneration with a one-layer SigLIP tower,
saved by the installed transformers (tensors `language_model.model.*`, as the released files
name them) and renamed to transformers 4.5x's layout (`model.language_model.*`). Measured:
logits of a text-only input 1e-6 of transformers' multimodal model.
"""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpar import models
from jaxpar.interop import hf, sharded
from jaxpar.models.attention_pattern import layer_kinds
from tests.support.gemma3_hf import VOCAB, gemma3_multimodal_model
from tests.support.hf_testing import assert_same_tree, max_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# transformers 4.5x's in-memory (and saved) names for the released files' prefixes.
OLDER_LAYOUT = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                "multi_modal_projector.": "model.multi_modal_projector."}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3_multimodal")
    model = gemma3_multimodal_model()
    model.save_pretrained(directory / "hf")
    older = directory / "older"
    older.mkdir()
    (older / "config.json").write_text((directory / "hf" / "config.json").read_text())
    tensors = load_file(str(directory / "hf" / "model.safetensors"))
    renamed = {next((new + k[len(old):] for old, new in OLDER_LAYOUT.items() if k.startswith(old)), k): v for k, v in tensors.items()}
    save_file(renamed, str(older / "model.safetensors"), metadata={"format": "pt"})
    return model, directory


def test_text_model_logits_match_transformers(checkpoint, capsys):
    model, directory = checkpoint
    assert any(k.startswith("language_model.model.layers.") for k in load_file(str(directory / "hf" / "model.safetensors")))
    cfg, params = hf.load(directory / "hf")
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "Gemma3ForConditionalGeneration" in note[0], note
    assert "multi_modal_projector, vision_tower are not loaded" in note[0], note
    assert cfg.model_type == "gemma3_text" and layer_kinds(cfg) == ["sliding_attention", "full_attention", "sliding_attention"]

    tokens = np.random.default_rng(0).integers(1, VOCAB, (2, 12)).astype(np.int32)  # 12 > the window of 4
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    got = np.asarray(jax.jit(lambda p: models.apply(cfg, p, tokens)[0])(params))[..., :VOCAB]
    error = max_err(got, want)
    print(f"max |logit error| {error:.1e} (|logits| up to {np.abs(want).max():.1f})")
    assert error < 1e-4


def test_older_layout_reads_the_same_and_preflight_passes(checkpoint, tmp_path):
    """transformers 4.5x's names give the same params; `train.init_from_hf`'s preflight finds every
    tensor in both layouts and its reader (slices onto devices) reads the same params; saving writes
    the text model alone, as Gemma3ForCausalLM."""
    _, directory = checkpoint
    cfg, params = hf.load(directory / "hf")
    cfg_older, params_older = hf.load(directory / "older")
    assert cfg_older == cfg
    assert_same_tree(params_older, params)
    one_device = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), models.param_shapes(cfg))
    for layout in ("hf", "older"):
        assert sharded.problems(str(directory / layout), cfg) == []
        assert_same_tree(jax.device_get(sharded.load_params_onto(str(directory / layout), cfg, one_device)), params)
    hf.save(tmp_path / "out", cfg, params)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


def test_released_text_config_takes_gemma3_defaults(tmp_path):
    """A released file's `text_config` holds only what differs from Gemma3TextConfig (here gemma-3-4b's)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "vision_config": {},
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    }))
    cfg = hf.model_config(tmp_path)
    want = transformers.Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, sliding_window=1024)
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "tie_word_embeddings", "query_pre_attn_scalar", "sliding_window", "hidden_size"):
        assert cfg[key] == getattr(want, key), key
    assert cfg.rope_scaling.factor == 8.0 and cfg.rope_local_base_freq == 10_000.0
    assert layer_kinds(cfg) == want.layer_types
