"""LoRA against PEFT: a jaxpar LoRA run's exported adapter, loaded by `peft.PeftModel.from_pretrained`
onto the transformers base, gives jaxpar's logits; an adapter made by peft (random, B non-zero),
imported, gives peft's logits; the merged export, loaded by transformers, gives peft's
`merge_and_unload` logits. All on a random tiny Llama (GQA, untied) in float32."""

import copy

import jax
import numpy as np
import pytest

from jaxpar import models
from jaxpar.interop import hf
from jaxpar.interop import peft as peft_format
from jaxpar.models import lora
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.hf_models import llama_model, torch

peft = pytest.importorskip("peft")

TARGETS = "q,k,v,o,gate,up,down"
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8.0
TOL = 1e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF folder, the torch model, jaxpar base config and params, tokens)."""
    folder = tmp_path_factory.mktemp("hf")
    model = llama_model("gqa_untied")
    model.save_pretrained(folder)
    cfg, params = hf.load(folder)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    return folder, model, cfg, params, tokens


def _adapted(cfg):
    return lora.adapted(cfg, tiny.llama(dict(lora=dict(rank=RANK, alpha=ALPHA, targets=TARGETS))).train.lora)


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _fresh(folder):
    return type(llama_model("gqa_untied")).from_pretrained(folder, attn_implementation="eager").eval()


def test_exported_adapter_loads_in_peft(base, tmp_path):
    folder, _, cfg, params, tokens = base
    config = tiny.llama(dict(lora=dict(rank=RANK, alpha=ALPHA, targets=TARGETS), learning_rate=3e-2, weight_decay=0.0))
    config.model = cfg
    program = build(config, jax.devices()[:1])
    state = program.init_from_params(params)
    batch = np.random.default_rng(1).integers(0, cfg.vocab_size, (16, 17)).astype(np.int32)
    for _ in range(2):  # B leaves zero: the export is a trained adapter
        state, _ = program.step(state, batch)
    trained = jax.device_get(program.to_natural(state).params)
    assert all(np.any(b) for p, b in lora.adapters_of(trained).items() if p[-1].endswith("_lora_b"))
    mine = np.asarray(models.forward(program.model_config, trained, tokens))
    peft_format.export(str(tmp_path / "adapter"), program.model_config, trained, base_model=str(folder))
    theirs = _torch_logits(peft.PeftModel.from_pretrained(_fresh(folder), tmp_path / "adapter").eval(), tokens)
    np.testing.assert_allclose(mine, theirs, atol=TOL, rtol=0)


def test_peft_adapter_imports_and_merges(base, tmp_path):
    folder, _, cfg, params, tokens = base
    torch.manual_seed(1)
    made = peft.get_peft_model(
        _fresh(folder), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS, init_lora_weights=False)
    ).eval()
    made.save_pretrained(tmp_path / "adapter")
    theirs = _torch_logits(made, tokens)
    adapted = _adapted(cfg)
    start = lora.with_init(copy.deepcopy(params), models.logical_axes(cfg), lora.settings(adapted), 0)
    imported = peft_format.with_adapters(start, peft_format.load(str(tmp_path / "adapter"), adapted))
    mine = np.asarray(models.forward(adapted, imported, tokens))
    np.testing.assert_allclose(mine, theirs, atol=TOL, rtol=0)
    # The merged export is a plain transformers checkpoint equal to PEFT's own merge.
    merged = jax.device_get(lora.merged(imported, lora.settings(adapted), models.logical_axes(adapted)))
    hf.save(tmp_path / "merged", cfg, merged)
    reloaded = _torch_logits(_fresh(tmp_path / "merged"), tokens)
    np.testing.assert_allclose(reloaded, _torch_logits(made.merge_and_unload(), tokens), atol=TOL, rtol=0)


def test_mismatched_adapter_is_refused(base, tmp_path):
    folder, _, cfg, _, _ = base
    made = peft.get_peft_model(_fresh(folder), peft.LoraConfig(r=2, lora_alpha=ALPHA, target_modules=HF_TARGETS))
    made.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"adapter_config.json: r=2.*train.lora.rank=4"):
        peft_format.load(str(tmp_path / "adapter"), _adapted(cfg))
