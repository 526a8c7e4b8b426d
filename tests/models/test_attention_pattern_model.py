"""The patterned decoder against transformers: a Llama with Ministral's layer pattern (alternating
sliding-window and full layers, window 4 < sequence 20) gives transformers' MinistralForCausalLM
logits (random weights, fp32, eager attention), on the XLA path and on jaxpar_xla, with the windows
the model initialises (sliding, sliding, full): each layer's window reaches it through the scan. (Sinks and soft-capping are
proven against gpt-oss's and Gemma 2's attention functions in test_attention_pattern.py.)
Measured: max |logit error| 1.1e-5 (xla), 8.6e-6 (jaxpar_xla), logits up to 7.0.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxpar import models
from jaxpar.interop import hf
from jaxpar.models import families
from jaxpar.models.options import RunOptions
from jaxpar.parallel.plan import SINGLE_DEVICE
from tests.support.hf_models import DEFAULT_ROPE, randomized
from tests.support.patterned_family import FAMILY, NAME, schema

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]


@pytest.fixture(autouse=True)
def patterned_family(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, NAME, FAMILY)


def _ministral(tmp_path):
    config = transformers.MinistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64, sliding_window=4,
        rope_parameters=dict(DEFAULT_ROPE),
        layer_types=LAYER_TYPES, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = randomized(transformers.MinistralForCausalLM(config)).eval()
    # The same tensors as a Llama checkpoint, read by jaxpar's Llama adapter.
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                                        "max_position_embeddings")
    }, rope_parameters=config.rope_parameters))
    missing = llama.load_state_dict(model.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    llama.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("impl", ["xla", "jaxpar_xla"])
def test_matches_transformers_ministral(impl, tmp_path):
    model = _ministral(tmp_path)
    tokens = np.random.default_rng(0).integers(0, 300, (2, 20)).astype(np.int32)
    with torch.no_grad():
        expected = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    cfg, params = hf.load(tmp_path)
    cfg = schema(**cfg.to_dict() | {"model_type": NAME, "sliding_window": 4, "layer_types": LAYER_TYPES})
    # The windows as the model initialises them (`PatternedDecoder`), the weights from the checkpoint.
    windows = np.asarray(models.init_params(cfg, 0)["layers"]["attention"]["window"])
    np.testing.assert_array_equal(windows, [[4], [4], [0]])
    params = dict(params)
    params["layers"] = {**params["layers"], "attention": {**params["layers"]["attention"], "window": windows}}
    opts = RunOptions(plan=dataclasses.replace(SINGLE_DEVICE, attention=impl))
    logits = jax.jit(lambda p, t: models.apply(cfg, p, t, opts)[0])(params, tokens)
    logits = np.asarray(logits)[..., : cfg.vocab_size]
    error = float(np.max(np.abs(logits - expected)))
    print(f"{impl}: max |logit error| {error:.1e}, |logits| max {np.abs(expected).max():.1f}")
    assert error < 1e-4, error
    # The pattern matters at this length: full attention everywhere is visibly different.
    params["layers"]["attention"]["window"] = np.zeros((3, 1), np.float32)
    full = np.asarray(jax.jit(lambda p, t: models.apply(cfg, p, t, opts)[0])(params, tokens))[..., : cfg.vocab_size]
    assert np.max(np.abs(full - expected)) > 1e-2
