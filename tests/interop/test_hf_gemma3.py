"""jaxpar's gemma3_text against transformers' Gemma3ForCausalLM: the random tiny model of
tests/support/gemma3_hf.py (fp32, eager attention: layers sliding / full / sliding with a window of
4, two RoPE bases, `query_pre_attn_scalar` 24, the final logit soft-cap on, tied embeddings) over
packed documents of up to 11 tokens.

The packed rows are checked against transformers running each document alone (positions from 0):
logits on both one-device attention paths, and the step-1 gradient of every parameter of the mean
next-token loss over the documents against `loss.backward()`, through the checkpoint layout
(`jaxpar.interop.hf`). The round trip jaxpar -> safetensors -> jaxpar is exact, and transformers
loads what jaxpar saves. Measured: logits 1.1e-5 of |logits| up to 5, gradients 2e-6 of each leaf's
largest element.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import models
from jaxpar.interop import hf
from jaxpar.models.options import RunOptions
from jaxpar.parallel.plan import SINGLE_DEVICE
from tests.support.gemma3_hf import VOCAB, gemma3_model
from tests.support.hf_oracle import as_jaxpar, gradients
from tests.support.hf_testing import assert_same_tree, max_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 20
DOCUMENTS = [[11, 9], [6, 8, 4]]  # each row's document lengths; the rest of a row is padding


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3")
    model = gemma3_model()
    assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    model.save_pretrained(directory / "hf")
    return model, directory


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (2, SEQ)).astype(np.int32)  # not 0: torch never updates pad_token_id's row
    segments, positions, spans = np.zeros((2, SEQ), np.int32), np.zeros((2, SEQ), np.int32), []
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for doc, n in enumerate(lengths):
            segments[row, start : start + n], positions[row, start : start + n] = doc + 1, np.arange(n)
            spans.append((row, start, start + n))
            start += n
    return tokens, segments, positions, spans


def test_logits_and_gradients_match_transformers(checkpoint):
    model, directory = checkpoint
    tokens, segments, positions, spans = _batch()
    model.zero_grad()
    want, losses, predicted = np.zeros((2, SEQ, VOCAB), np.float32), [], 0
    for row, a, b in spans:  # transformers, one document at a time
        logits = model(torch.as_tensor(tokens[row : row + 1, a:b], dtype=torch.long), use_cache=False).logits[0]
        want[row, a:b] = logits.detach().numpy()
        targets = torch.as_tensor(tokens[row, a + 1 : b], dtype=torch.long)
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum"))
        predicted += b - a - 1
    loss = sum(losses) / predicted
    loss.backward()

    cfg, params = hf.load(directory / "hf")
    real = segments != 0
    targets = np.roll(tokens, -1, axis=1)
    has_target = real & (np.roll(segments, -1, axis=1) == segments)
    has_target[:, -1] = False

    def mean_loss(p, opts):
        logits = models.apply(cfg, p, tokens, opts, positions=positions, segment_ids=segments)[0][..., :VOCAB]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(has_target, picked, 0.0)) / has_target.sum(), logits

    for impl in ("xla", "jaxpar_xla"):
        opts = RunOptions(plan=dataclasses.replace(SINGLE_DEVICE, attention=impl))
        (value, logits), grads = jax.jit(jax.value_and_grad(mean_loss, has_aux=True), static_argnums=1)(params, opts)
        error = max_err(np.asarray(logits)[real], want[real])
        print(f"{impl}: max |logit error| {error:.1e} (|logits| up to {np.abs(want).max():.1f}); loss {float(value):.6f} "
              f"vs transformers {float(loss):.6f}")
        assert error < 1e-4
        assert abs(float(value) - float(loss)) < 1e-5

    expected = as_jaxpar(model, gradients(model), directory / "grads")[1]
    del expected["layers"]["attention"]["window"], grads["layers"]["attention"]["window"]  # config, not a tensor
    errors = jax.tree.map(lambda g, r: float(np.max(np.abs(np.asarray(g) - r)) / np.max(np.abs(r))), grads, expected)
    worst = max(jax.tree.leaves(errors))
    print(f"worst gradient error {worst:.1e} of each leaf's largest element")
    assert worst < 2e-5, errors


def test_round_trip_is_exact_and_transformers_loads_it(checkpoint, tmp_path):
    model, directory = checkpoint
    cfg, params = hf.load(directory / "hf")
    hf.save(tmp_path / "out", cfg, jax.tree.map(jnp.asarray, params))
    cfg2, params2 = hf.load(tmp_path / "out")
    assert cfg2 == cfg
    assert_same_tree(params2, params)
    reloaded, info = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    assert reloaded.config.layer_types == model.config.layer_types
    tokens = torch.as_tensor(_batch()[0], dtype=torch.long)
    with torch.no_grad():
        assert max_err(reloaded.eval()(tokens).logits, model(tokens).logits) == 0.0


def test_an_attention_soft_cap_is_refused(checkpoint, tmp_path):
    """transformers' Gemma 3 keeps `attn_logit_softcapping` but never applies it: refused, not silently dropped."""
    _, directory = checkpoint
    (tmp_path / "config.json").write_text(
        json.dumps({**json.loads((directory / "hf" / "config.json").read_text()), "attn_logit_softcapping": 50.0}))
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0 is not supported"):
        hf.model_config(tmp_path)


def test_the_two_rope_rows_are_each_kinds_own_base():
    """Full layers: rope_theta with linear scaling (inverse frequencies divided by its factor); sliding
    layers: rope_local_base_freq unscaled — each row against its closed form."""
    from jaxpar.models.gemma3_text import rope_frequencies
    from tests.support import tiny

    cfg = tiny.gemma3_text().model
    dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    exponents = np.arange(0, dim, 2) / dim
    full, local = np.asarray(rope_frequencies(cfg))
    np.testing.assert_allclose(full, 1.0 / (1e6**exponents) / 2.0, rtol=1e-6)
    np.testing.assert_allclose(local, 1.0 / (1e4**exponents), rtol=1e-6)
