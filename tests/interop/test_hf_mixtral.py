"""jaxpar.interop.hf against transformers' MixtralForCausalLM: random tiny models built here.

Weights are drawn with a large std (router included, so routing is decisive) and norm weights away
from 1, so a swapped or mis-laid-out tensor moves the logits by far more than the tolerance.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from jaxpar import models  # noqa: E402
from jaxpar.interop import hf  # noqa: E402
from tests.support.hf_models import MIXTRAL_CASES, mixtral_model  # noqa: E402
from tests.support.hf_testing import assert_same_tree, max_err, tokens_for  # noqa: E402


def hf_outputs(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens), output_router_logits=True)


@pytest.mark.parametrize("case", sorted(MIXTRAL_CASES))
def test_load_matches_hf_and_save_round_trips(case, tmp_path):
    model = mixtral_model(case)
    model.save_pretrained(tmp_path / "hf")
    tokens = tokens_for(model)
    expected = hf_outputs(model, tokens)

    cfg, params = hf.load(tmp_path / "hf")
    assert cfg.model_type == "mixtral" and cfg.num_local_experts == model.config.num_local_experts
    assert cfg.router_aux_loss_coef == 0.02 and cfg.capacity_factor == 0.0
    logits, aux = jax.jit(lambda p, t: models.apply(cfg, p, t))(params, jnp.asarray(tokens))
    logits = np.asarray(logits)[..., : cfg.vocab_size]
    err = max_err(logits, expected.logits)
    print(f"{case}: jaxpar vs HF logits max abs {err:.2e}, |logits| max {np.abs(expected.logits.numpy()).max():.1f}")
    assert err < 1e-4
    np.testing.assert_array_equal(logits, models.forward(cfg, params, tokens))

    # Router losses and statistics from the same batch.
    extra, metrics = models.aux_losses(cfg, aux)
    router_logits = torch.cat(expected.router_logits).float()  # [layers * tokens, E]
    z_loss = float((torch.logsumexp(router_logits, -1) ** 2).mean())
    chosen = torch.topk(router_logits.softmax(-1), cfg.num_experts_per_tok, dim=-1).indices
    fraction = torch.bincount(chosen.flatten(), minlength=cfg.num_local_experts) / chosen.numel()
    print(f"{case}: aux loss {float(metrics['aux_loss']):.7f} vs HF {float(expected.aux_loss):.7f}")
    np.testing.assert_allclose(metrics["aux_loss"], float(expected.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(metrics["z_loss"], z_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["expert_fraction"], fraction.numpy(), atol=1e-7)
    np.testing.assert_allclose(extra, 0.02 * float(expected.aux_loss), rtol=1e-5)  # z-loss coefficient 0
    assert metrics["dropped_fraction"] == 0

    # Save from jax arrays, reload with transformers: same model, no missing or unexpected keys.
    hf.save(tmp_path / "out", cfg, jax.tree.map(jnp.asarray, params))
    reloaded, info = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info
    round_trip = hf_outputs(reloaded.eval(), tokens)
    print(f"{case}: saved vs original HF max abs {max_err(round_trip.logits, expected.logits):.2e}")
    assert max_err(round_trip.logits, expected.logits) < 1e-5

    cfg2, params2 = hf.load(tmp_path / "out")
    assert cfg2 == cfg
    assert_same_tree(params2, params)


def test_fused_in_memory_layout_loads(tmp_path):
    """transformers 5 keeps experts fused in memory (`mlp.experts.gate_up_proj` [E, 2F, D],
    `mlp.experts.down_proj`, `mlp.gate.weight`); a raw state_dict dump in that layout loads the same."""
    model = mixtral_model("e4_top2")
    model.save_pretrained(tmp_path / "per_expert")
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "fused").mkdir()
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())

    cfg, params = hf.load(tmp_path / "per_expert")
    fused_cfg, fused_params = hf.load(tmp_path / "fused")
    assert fused_cfg == cfg
    assert_same_tree(fused_params, params)


def test_sliding_window_rejected(tmp_path):
    mixtral_model("e4_top2").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding_window=16 is not supported"):
        hf.load(tmp_path)
