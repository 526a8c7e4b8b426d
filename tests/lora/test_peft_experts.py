"""Expert adapters against PEFT (`target_parameters` on transformers 5's fused expert parameters): a
jaxpar adapter on attention and expert matrices, exported, loaded by `peft.PeftModel.from_pretrained`
onto the transformers Mixtral gives jaxpar's logits; an adapter made by peft on the same parameters
(rank r on gate_up_proj: one A for gate and up), imported, gives peft's logits. Random tiny
Mixtral (4 experts, top-2) in float32, adapters with non-zero B."""

import copy

import numpy as np
import pytest

from jaxpar import models
from jaxpar.interop import hf
from jaxpar.interop import peft as peft_format
from jaxpar.models import lora
from tests.support import tiny
from tests.support.hf_models import mixtral_model, torch

peft = pytest.importorskip("peft")

TARGETS = "q,v,gate,up,down"
RANK, ALPHA = 2, 4.0
TOL = 1e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF folder, the adapted jaxpar config, base params, tokens)."""
    folder = tmp_path_factory.mktemp("hf")
    mixtral_model("e4_top2").save_pretrained(folder)
    cfg, params = hf.load(folder)
    adapted = lora.adapted(cfg, tiny.mixtral(dict(lora=dict(rank=RANK, alpha=ALPHA, targets=TARGETS))).train.lora)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
    return folder, adapted, params, tokens


def _fresh(folder):
    return type(mixtral_model("e4_top2")).from_pretrained(folder, attn_implementation="eager").eval()


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _with_random_adapters(adapted, params, seed):
    start = lora.with_init(copy.deepcopy(params), models.logical_axes(lora.base_config(adapted)), lora.settings(adapted), seed)
    rng = np.random.default_rng(seed)
    return peft_format.with_adapters(start, {p: rng.normal(0, 0.2, x.shape).astype(np.float32) for p, x in lora.adapters_of(start).items()})


def test_exported_expert_adapter_loads_in_peft(base, tmp_path):
    folder, adapted, params, tokens = base
    mine_params = _with_random_adapters(adapted, params, 1)
    mine = np.asarray(models.forward(adapted, mine_params, tokens))
    peft_format.export(str(tmp_path / "adapter"), adapted, mine_params, base_model=str(folder))
    loaded = peft.PeftModel.from_pretrained(_fresh(folder), tmp_path / "adapter").eval()
    theirs = _torch_logits(loaded, tokens)
    base_logits = _torch_logits(_fresh(folder), tokens)
    assert np.max(np.abs(theirs - base_logits)) > 0.05  # the expert adapters were applied, not skipped
    np.testing.assert_allclose(mine, theirs, atol=TOL, rtol=0)
    # Read back: the same adapters (gate and up out of their rank-2r block form).
    again = peft_format.load(str(tmp_path / "adapter"), adapted)
    for path, value in again.items():
        holder = mine_params
        for k in path:
            holder = holder[k]
        np.testing.assert_allclose(value, holder, atol=1e-6, rtol=0)


def test_peft_expert_adapter_imports(base, tmp_path):
    folder, adapted, params, tokens = base
    torch.manual_seed(2)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], init_lora_weights=False,
    )
    made = peft.get_peft_model(_fresh(folder), config).eval()
    made.save_pretrained(tmp_path / "adapter")
    # Not the fixture's tokens: under these adapters one of their tokens (layer 1, row 0, position 7)
    # has its 2nd and 3rd router logits 1.8e-6 apart, so torch's and XLA's fp32 noise picks its
    # experts (measured: 1.7 off on one host, equal on another). These tokens' smallest gap is 9e-3.
    tokens = np.random.default_rng(2).integers(0, adapted.vocab_size, tokens.shape).astype(np.int32)
    theirs = _torch_logits(made, tokens)
    start = lora.with_init(copy.deepcopy(params), models.logical_axes(lora.base_config(adapted)), lora.settings(adapted), 0)
    imported = peft_format.with_adapters(start, peft_format.load(str(tmp_path / "adapter"), adapted))
    np.testing.assert_allclose(np.asarray(models.forward(adapted, imported, tokens)), theirs, atol=TOL, rtol=0)


@pytest.mark.parametrize("make, model", [(tiny.qwen3_moe, dict(mlp_only_layers=[1])), (tiny.qwen2_moe, {})])
def test_dense_mlps_named_like_experts_are_refused(make, model, tmp_path):
    """PEFT 0.21.2 turns target_modules gate_proj / up_proj / down_proj of a Qwen3-MoE into its fused experts
    (measured: a dense layer's adapters then go unloaded, logits off by 6.5): such an export is refused."""
    config = make(dict(lora=dict(rank=2, alpha=4.0, targets="q,gate,up,down")), **model)
    with pytest.raises(ValueError, match=r"train.lora.targets: down_proj,gate_proj,up_proj of .* share their names"):
        peft_format.export(str(tmp_path), lora.adapted(config.model, config.train.lora), params=None)
