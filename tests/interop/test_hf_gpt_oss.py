"""jaxpar's gpt-oss against transformers' GptOssForCausalLM: a random tiny model built here (fp32,
eager attention, the experts' eager loop: the forward transformers documents, which its training
mode runs too), 3 layers sliding / full / sliding with a window of 4 over packed documents of up to
13 tokens, YaRN (gpt-oss's: the ramp not truncated), sinks, every bias random, the SwiGLU clamp at
2 so that it bites.

The packed rows are checked against transformers running each document alone (its own positions
from 0): logits, and the step-1 gradient of every parameter of the mean next-token loss over the
documents (`loss.backward()`), through the checkpoint layout (`jaxpar.interop.hf`). The round trip
jaxpar -> safetensors -> jaxpar is exact, and transformers loads what jaxpar saves.

MXFP4 (the released checkpoints' experts) is checked against a dequantization written here from
the OCP Microscaling definition, against transformers' own, and end to end: a checkpoint whose
experts are stored as blocks and scales loads to the same parameters as their dequantized values.
"""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import models
from jaxpar.interop import hf
from jaxpar.models.gpt_oss import mxfp4
from tests.support.gpt_oss_hf import LAYER_TYPES, VOCAB, WINDOW, gpt_oss_model
from tests.support.hf_testing import assert_same_tree, max_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

SEQ = 20
# Each row's documents (lengths); the rest of the row is padding.
DOCUMENTS = [[13, 7], [5, 9, 4]]


def _batch():
    """tokens, segment ids, positions [2, SEQ] of the packed rows, and each row's documents as token lists."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)
    segments, positions = np.zeros((2, SEQ), np.int32), np.zeros((2, SEQ), np.int32)
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for doc, n in enumerate(lengths):
            segments[row, start : start + n] = doc + 1
            positions[row, start : start + n] = np.arange(n)
            start += n
    return tokens, segments, positions


def _spans():
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for n in lengths:
            yield row, start, start + n
            start += n


def _targets(tokens, segments):
    """Next-token targets within each document, and the mask of positions that have one."""
    targets = np.roll(tokens, -1, axis=1)
    mask = (segments != 0) & (np.roll(segments, -1, axis=1) == segments)
    mask[:, -1] = False
    return targets, mask


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt_oss")
    model = gpt_oss_model()
    model.save_pretrained(directory / "hf")
    return model, directory


def test_logits_and_gradients_match_transformers(checkpoint):
    model, directory = checkpoint
    tokens, segments, positions = _batch()
    targets, mask = _targets(tokens, segments)
    # transformers, one document at a time; the loss is the mean over every predicted token.
    model.zero_grad()
    want_logits, losses = np.zeros((2, SEQ, VOCAB), np.float32), []
    for row, a, b in _spans():
        logits = model(torch.as_tensor(tokens[row : row + 1, a:b], dtype=torch.long)).logits[0]
        want_logits[row, a:b] = logits.detach().numpy()
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], torch.as_tensor(tokens[row, a + 1 : b], dtype=torch.long),
                                                        reduction="sum"))
    loss = sum(losses) / int(mask.sum())
    loss.backward()

    cfg, params = hf.load(directory / "hf")
    assert cfg.model_type == "gpt_oss" and list(cfg.layer_types) == LAYER_TYPES and cfg.sliding_window == WINDOW
    np.testing.assert_array_equal(np.asarray(params["layers"]["attention"]["window"])[:, 0], [WINDOW, 0, WINDOW])

    def jax_loss(p):
        logits, _ = models.apply(cfg, p, tokens, positions=positions, segment_ids=segments)
        logp = jax.nn.log_softmax(logits[..., :VOCAB], axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(mask, picked, 0.0)) / mask.sum(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(jax_loss, has_aux=True))(params)
    logits = np.asarray(logits)[..., :VOCAB]
    real = segments != 0
    error = max_err(logits[real], want_logits[real])
    print(f"logits max abs error {error:.1e} (|logits| max {np.abs(want_logits).max():.1f}); "
          f"loss {float(value):.6f} vs {float(loss):.6f}")
    assert error < 1e-4
    assert abs(float(value) - float(loss)) < 1e-5

    # Every parameter's gradient, as transformers lays it out (the same adapter `save` writes with).
    hf.save(directory / "grads", cfg, jax.tree.map(np.asarray, grads))
    got = load_file(str(directory / "grads" / "model.safetensors"))
    want = {name: p.grad.numpy() for name, p in model.named_parameters()}
    assert set(got) == set(want), set(got) ^ set(want)
    worst = max((max_err(got[n], want[n]) / max(np.abs(want[n]).max(), 1e-12), n) for n in want)
    print(f"gradients: worst max abs error relative to the tensor's largest {worst[0]:.1e} ({worst[1]})")
    assert worst[0] < 1e-4, worst


def test_round_trip_is_exact_and_transformers_loads_it(checkpoint):
    model, directory = checkpoint
    cfg, params = hf.load(directory / "hf")
    hf.save(directory / "out", cfg, jax.tree.map(jnp.asarray, params), overwrite=True)
    reloaded, info = transformers.GptOssForCausalLM.from_pretrained(
        directory / "out", attn_implementation="eager", experts_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info
    original, saved = model.state_dict(), reloaded.state_dict()
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name
    cfg2, params2 = hf.load(directory / "out")
    assert cfg2 == cfg
    assert_same_tree(params2, params)


def test_bfloat16_checkpoint_loads_its_values_exactly(checkpoint, tmp_path):
    """A bf16 checkpoint (what the released unquantized weights are) loads to the fp32 checkpoint's
    values rounded to bf16, bit for bit: its MXFP4-free experts de-interleaved like fp32 ones."""
    model, directory = checkpoint
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)
    _, params = hf.load(tmp_path)
    _, params32 = hf.load(directory / "hf")
    rounded = jax.tree.map(lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32)), params32)
    assert_same_tree(params, rounded)


def test_bfloat16_export_is_the_weights_rounded(checkpoint, tmp_path):
    """`save(dtype="bfloat16")` (convert.py --hf_dtype=bfloat16) writes what torch's own rounding of
    the weights to bf16 is, bit for bit, and transformers loads it as bf16 with no missing keys."""
    model, directory = checkpoint
    cfg, params = hf.load(directory / "hf")
    hf.save(tmp_path, cfg, params, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded, info = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", experts_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info
    saved = reloaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], tensor.to(torch.bfloat16)), name


# ---- MXFP4 ----

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _by_definition(blocks, scales):
    """OCP Microscaling v1.0, element by element: 32 E2M1 elements per block (two per byte, the
    lower index in the low nibble: sign bit 3, magnitude bits 0-2) times 2^(scale - 127)."""
    *lead, groups, _ = blocks.shape
    out = np.zeros((*lead, groups * 32), np.float64)
    for index in np.ndindex(*lead, groups):
        scale = 2.0 ** (int(scales[index]) - 127)
        for j, byte in enumerate(blocks[index]):
            for half, nibble in enumerate((int(byte) & 0xF, int(byte) >> 4)):
                value = E2M1[nibble & 7] * (-1.0 if nibble & 8 else 1.0)
                out[(*index[:-1], index[-1] * 32 + 2 * j + half)] = value * scale
    return out


def _random_mxfp4(rng, shape):
    """blocks [*shape, 16] and scales `shape`: every nibble, and exponents around 2^0 (127 ± 8)."""
    return rng.integers(0, 256, (*shape, 16), dtype=np.uint8), rng.integers(119, 136, shape, dtype=np.uint8)


def test_mxfp4_dequantization_follows_the_definition_and_transformers():
    rng = np.random.default_rng(0)
    blocks, scales = _random_mxfp4(rng, (2, 3, 2))
    blocks[0, 0, 0] = np.arange(16, dtype=np.uint8) * 17  # both nibbles of every code
    scales[0, 0, 0], scales[0, 0, 1] = 1, 250  # near both ends of float32 (2^-126 · 0.5 is subnormal)
    got = mxfp4.dequantize(blocks, scales)
    np.testing.assert_array_equal(got, _by_definition(blocks, scales))
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32)
    # transformers returns [E, in, out] (its in-memory layout): ours is [E, out, in].
    np.testing.assert_array_equal(got.transpose(0, 2, 1), theirs.numpy())


def test_mxfp4_checkpoint_loads_its_dequantized_experts(checkpoint, tmp_path):
    """The experts stored as blocks and scales (as the released checkpoints hold them) load to the
    parameters of a checkpoint holding their dequantized values."""
    _, directory = checkpoint
    tensors = load_file(str(directory / "hf" / "model.safetensors"))
    rng = np.random.default_rng(1)
    quantized, dense = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        experts, d_in, d_out = tensors[name].shape
        blocks, scales = _random_mxfp4(rng, (experts, d_out, d_in // 32))
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dense[name] = np.ascontiguousarray(_by_definition(blocks, scales).astype(np.float32).transpose(0, 2, 1))
    config = json.loads((directory / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    for name, held in (("mxfp4", quantized), ("dense", dense)):
        (tmp_path / name).mkdir()
        save_file(held, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    cfg, params = hf.load(tmp_path / "mxfp4")
    cfg_dense, params_dense = hf.load(tmp_path / "dense")
    assert cfg == cfg_dense
    assert_same_tree(params, params_dense)
    assert np.any(params["layers"]["mlp"]["experts"]["gate"] != hf.load(directory / "hf")[1]["layers"]["mlp"]["experts"]["gate"])

    # What `train.init_from_hf` does: preflight finds the MXFP4 layout acceptable, and each device's
    # blocks (experts over expert, their hidden dim over tensor) are those of the whole-tensor load.
    from jaxpar.interop import sharded
    from jaxpar.train.setup import build
    from tests.support import tiny

    assert sharded.problems(str(tmp_path / "mxfp4"), cfg) == []
    config = tiny.with_overrides(tiny.gpt_oss(), {"data": 2, "expert": 2, "tensor": 2})
    config.model = cfg
    program = build(config)
    loaded = sharded.load_params_onto(str(tmp_path / "mxfp4"), cfg, program.state_shardings.params)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))


# ---- the released models' config.json ----


def _released(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b's and -120b's config.json as published (they differ in these two sizes)."""
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
        "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
        "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": layers, "num_key_value_heads": 8, "num_local_experts": experts, "output_router_logits": False,
        "pad_token_id": 199999, "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05, "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }


@pytest.mark.parametrize("name, layers, experts", [("gpt_oss_20b", 24, 32), ("gpt_oss_120b", 36, 128)])
def test_shipped_configs_are_the_released_models(name, layers, experts, tmp_path):
    """configs/gpt_oss_{20b,120b}.py's model is what the released config.json reads as (so
    `train.init_from_hf` takes the released weights with the shipped config as it is)."""
    from jaxpar.command.config_file import load_config
    from tests.support.paths import REPO

    (tmp_path / "config.json").write_text(json.dumps(_released(layers, experts)))
    released = hf.model_config(tmp_path)
    shipped = load_config(str(REPO / "configs" / f"{name}.py")).model
    assert released.to_dict() == shipped.to_dict()
