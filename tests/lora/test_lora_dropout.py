"""LoRA dropout (`train.lora.dropout` > 0) against PEFT and against one device.

Against PEFT: jaxpar's forward and adapter gradients with a step's dropout key equal PEFT's LoRA
modules (`lora_dropout` > 0, the same adapters) whose dropout modules apply the same masks (each
(layer, matrix) its own, drawn by `jaxpar.models.lora_dropout.keep_mask`); without a key (evaluation,
sampling) jaxpar's logits are PEFT's in eval mode. On a mesh: a dropout run on data 2 × tensor 2 with
sequence parallelism takes the same steps as on one device (the masks do not depend on the mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import models
from jaxpar.interop import hf
from jaxpar.interop import peft as peft_format
from jaxpar.models import lora, lora_dropout
from jaxpar.models.options import RunOptions
from jaxpar.parallel.context.sequence import document_batch
from jaxpar.train.loss import model_loss
from tests.support import tiny
from tests.support.hf_models import llama_model, torch
from tests.support.reference import assert_matches_reference, run, single_device, synthetic_batches

peft = pytest.importorskip("peft")

TARGETS = "q,k,v,o,gate,up,down"
HF = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
      "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
MODULE = {name: "attention" if name in "qkvo" else "mlp" for name in HF}
RANK, ALPHA, DROPOUT, STEP = 4, 8.0, 0.25, 7


class FixedMask(torch.nn.Module):
    """A dropout module with a given mask: x · mask / (1 - p), like torch's nn.Dropout."""

    def __init__(self, mask):
        super().__init__()
        self.mask = torch.tensor(np.asarray(mask), dtype=torch.float32)

    def forward(self, x):
        return x * self.mask.reshape(x.shape) / (1 - DROPOUT)


def _masks(cfg, shapes):
    """{(layer, matrix): keep mask} as jaxpar draws them at step STEP."""
    out = {}
    for name, shape in shapes.items():
        keys = lora_dropout.layer_keys(lora_dropout.step_key(STEP), ("layers", MODULE[name]), (cfg.num_hidden_layers,))
        for layer in range(cfg.num_hidden_layers):
            out[layer, name] = np.asarray(lora_dropout.keep_mask(jax.random.wrap_key_data(keys[layer]), name, shape, DROPOUT))
    return out


def test_dropout_matches_peft_with_the_same_masks(tmp_path):
    folder = tmp_path / "hf"
    llama_model("gqa_untied").save_pretrained(folder)
    cfg, params = hf.load(folder)
    section = tiny.llama(dict(lora=dict(rank=RANK, alpha=ALPHA, targets=TARGETS, dropout=DROPOUT))).train.lora
    adapted = lora.adapted(cfg, section)
    rng = np.random.default_rng(0)
    params = lora.with_init(params, models.logical_axes(cfg), lora.settings(adapted), 0)
    params = peft_format.with_adapters(jax.device_get(params), {
        p: rng.normal(0, 0.1, x.shape).astype(np.float32) for p, x in lora.adapters_of(params).items()
    })
    tokens = rng.integers(0, cfg.vocab_size, (2, 6)).astype(np.int32)
    weights = rng.normal(size=(2, 6, cfg.vocab_size)).astype(np.float32)

    def objective(p, opts):
        logits = models.apply(adapted, p, jnp.asarray(tokens), opts)[0][..., : cfg.vocab_size]
        return jnp.sum(logits * weights), logits

    (_, mine), grads = jax.value_and_grad(objective, has_aux=True)(params, RunOptions(lora_dropout_key=lora_dropout.step_key(STEP)))
    evaluated = np.asarray(objective(params, RunOptions())[1])

    peft_format.export(str(tmp_path / "adapter"), adapted, params)
    model = peft.PeftModel.from_pretrained(type(llama_model("gqa_untied")).from_pretrained(folder), tmp_path / "adapter",
                                           is_trainable=True).eval()
    with torch.no_grad():
        np.testing.assert_allclose(evaluated, model(torch.tensor(tokens, dtype=torch.long)).logits.numpy(), atol=1e-4, rtol=0)
    inputs = {n: (2, 6, cfg.hidden_size) for n in ("q", "k", "v", "gate", "up")}
    inputs |= {"o": (2, 6, cfg.num_attention_heads, cfg.head_dim), "down": (2, 6, cfg.intermediate_size)}  # o: heads split out
    masks = _masks(cfg, inputs)
    # Each (layer, matrix) draws its own mask, at about the keep rate.
    flat = [m.ravel() for m in masks.values()]
    assert all(not np.array_equal(a[: 64], b[: 64]) for i, a in enumerate(flat) for b in flat[i + 1 :])
    assert abs(np.mean(np.concatenate(flat)) - (1 - DROPOUT)) < 0.03
    layers = model.base_model.model.model.layers
    for (layer, name), mask in masks.items():
        holder = layers[layer]
        for part in HF[name].split("."):
            holder = getattr(holder, part)
        holder.lora_dropout["default"] = FixedMask(mask)
    logits = model(torch.tensor(tokens, dtype=torch.long)).logits
    (logits * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(np.asarray(mine), logits.detach().numpy(), atol=1e-4, rtol=0)
    assert np.max(np.abs(np.asarray(mine) - evaluated)) > 1e-2  # the masks changed something
    for name, module in HF.items():
        for layer in range(cfg.num_hidden_layers):
            holder = layers[layer]
            for part in module.split("."):
                holder = getattr(holder, part)
            a = np.asarray(grads["layers"][MODULE[name]][name + "_lora_a"][layer])
            b = np.asarray(grads["layers"][MODULE[name]][name + "_lora_b"][layer])
            want_a, want_b = holder.lora_A["default"].weight.grad.numpy(), holder.lora_B["default"].weight.grad.numpy()
            for got, want in ((a.reshape(-1, RANK).T, want_a), (b.reshape(RANK, -1).T, want_b)):
                np.testing.assert_allclose(got, want, atol=2e-4 * np.max(np.abs(want)), rtol=0, err_msg=f"{name} layer {layer}")


@pytest.mark.slow
def test_dropout_run_on_a_mesh_matches_one_device(shared_cache):
    config = tiny.with_overrides(tiny.llama({"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.3}}), {"data": 2, "tensor": 2},
                                 parallel={"sequence_parallel": True})
    batches = synthetic_batches(config, 2)
    reference = single_device(shared_cache, config, 2)
    result = run(config, batches, 4, reference["init_params"])
    assert_matches_reference(result, reference)
    # Dropout was on: the step's gradient is not the loss's gradient without dropout.
    adapted = lora.adapted(config.model, config.train.lora)
    rows = document_batch(jnp.asarray(batches[0]))
    loss = lambda p: model_loss(p, rows, None, model_config=adapted, opts=RunOptions(), scale=1.0)[0]  # noqa: E731
    plain = lora.adapters_of(jax.device_get(jax.jit(jax.grad(loss))(reference["init_params"])))
    stepped = lora.adapters_of(reference["grads1"])
    assert max(float(np.max(np.abs(plain[p] - g))) / float(np.max(np.abs(g))) for p, g in stepped.items() if np.any(g)) > 1e-2


@pytest.mark.parametrize("make, targets, missing", [
    (tiny.mixtral, "q,gate", {"experts.gate"}),
    (tiny.deepseek_v3, "o,q_a,down", {"attention.o", "attention.q_a", "experts.down"}),
])
def test_dropout_refuses_matrices_without_a_side_path(make, targets, missing):
    """Experts (PEFT's ParamWrapper refuses lora_dropout too), MLA's projections: one line naming them;
    the dense MLPs among them (DeepSeek's first layers, its shared experts) have one."""
    config = make(dict(lora=dict(rank=2, alpha=4.0, targets=targets, dropout=0.1)))
    misses = models.side_path_misses(lora.adapted(config.model, config.train.lora))
    assert {".".join(m.split(".")[-2:]) for m in misses} == missing
    (line,) = lora_dropout.problems(config.train.lora, 1, 1, lambda: misses)
    assert line.startswith(f"train.lora.dropout=0.1: {', '.join(misses)} have no side path")


def test_dropout_zero_keeps_the_folded_model():
    """dropout 0: the model config carries no dropout, the step adds no key, and a key changes nothing (bitwise)."""
    config = tiny.llama(dict(lora=dict(rank=4, alpha=8.0)))
    adapted = lora.adapted(config.model, config.train.lora)
    assert "dropout" not in adapted.lora
    opts = RunOptions()
    assert lora_dropout.training(opts, adapted, jnp.int32(3)) is opts
    params = models.init_params(adapted, 0)
    params = peft_format.with_adapters(jax.device_get(params), {
        p: np.full(x.shape, 0.05, np.float32) for p, x in lora.adapters_of(params).items()
    })
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, adapted.vocab_size, (2, 8)))
    forward = jax.jit(lambda p, key: models.apply(adapted, p, tokens, RunOptions(lora_dropout_key=key))[0])
    np.testing.assert_array_equal(forward(params, lora_dropout.step_key(3)), jax.jit(lambda p: models.apply(adapted, p, tokens)[0])(params))
