"""jaxpar.interop.hf against transformers' Qwen3, Qwen3-MoE and Qwen2-MoE: random tiny models (tests/support/hf_models.py).

Weights are drawn with a large std (routers included, so routing is decisive) and norm weights away
from 1, so a swapped or mis-laid-out tensor moves the logits by far more than the tolerance. Each
case exercises one feature: QK-norm with head_dim != hidden / heads, GQA / MQA, tied embeddings,
many experts with `norm_topk_prob` on and off, dense layers among MoE layers (`mlp_only_layers`,
`decoder_sparse_step`), the shared expert with its sigmoid gate, q/k/v biases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from jaxpar import models  # noqa: E402
from jaxpar.interop import hf  # noqa: E402
from jaxpar.models.qwen3_moe.schema import dense_layers  # noqa: E402
from tests.support.hf_models import QWEN_ARCH, QWEN_CASES, qwen_model  # noqa: E402
from tests.support.hf_testing import assert_same_tree, max_err, tokens_for  # noqa: E402
from tests.support.tiers import slow_except  # noqa: E402

ARCH, CASES = QWEN_ARCH, QWEN_CASES
hf_model = qwen_model


def hf_outputs(model, tokens):
    moe = model.config.model_type != "qwen3"
    with torch.no_grad():
        return model(torch.as_tensor(tokens), output_router_logits=True) if moe else model(torch.as_tensor(tokens))


# Fast tier: one case per family.
@pytest.mark.parametrize("case", slow_except(sorted(CASES), "qwen3_gqa_head_dim", "qwen3_moe_e16_top4_norm", "qwen2_moe_shared_qkv_bias"))
def test_load_matches_hf_and_save_round_trips(case, tmp_path):
    family = CASES[case][0]
    model = hf_model(case)
    model.save_pretrained(tmp_path / "hf")
    tokens = tokens_for(model)
    expected = hf_outputs(model, tokens)

    cfg, params = hf.load(tmp_path / "hf")
    assert cfg.model_type == family
    logits, aux = jax.jit(lambda p, t: models.apply(cfg, p, t))(params, jnp.asarray(tokens))
    logits = np.asarray(logits)[..., : cfg.vocab_size]
    err = max_err(logits, expected.logits)
    print(f"{case}: jaxpar vs HF logits max abs {err:.2e}, |logits| max {np.abs(expected.logits.numpy()).max():.1f}")
    assert err < 1e-4
    np.testing.assert_array_equal(logits, models.forward(cfg, params, tokens))

    if family != "qwen3":
        # transformers' load_balancing_loss_func over the MoE layers' router logits only.
        assert len(expected.router_logits) == cfg.num_hidden_layers - len(dense_layers(cfg))
        extra, metrics = models.aux_losses(cfg, aux)
        router_logits = torch.cat(expected.router_logits).float()
        chosen = torch.topk(router_logits.softmax(-1), cfg.num_experts_per_tok, dim=-1).indices
        fraction = torch.bincount(chosen.flatten(), minlength=cfg.num_experts) / chosen.numel()
        np.testing.assert_allclose(metrics["aux_loss"], float(expected.aux_loss), rtol=1e-5)
        np.testing.assert_allclose(metrics["expert_fraction"], fraction.numpy(), atol=1e-7)
        np.testing.assert_allclose(extra, 0.02 * float(expected.aux_loss), rtol=1e-5)  # z-loss coefficient 0

    # Save from jax arrays, reload with transformers: same model, no missing or unexpected keys.
    hf.save(tmp_path / "out", cfg, jax.tree.map(jnp.asarray, params))
    reloaded, info = getattr(transformers, ARCH[family][1]).from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info
    round_trip = hf_outputs(reloaded.eval(), tokens)
    assert max_err(round_trip.logits, expected.logits) < 1e-5
    cfg2, params2 = hf.load(tmp_path / "out")
    assert cfg2 == cfg
    assert_same_tree(params2, params)


def test_qwen3_moe_fused_in_memory_layout_loads(tmp_path):
    """transformers 5 keeps experts fused in memory (`mlp.experts.gate_up_proj` [E, 2F, D],
    `mlp.experts.down_proj`); a raw state_dict dump in that layout loads the same."""
    model = hf_model("qwen3_moe_dense_layer_tied")
    model.save_pretrained(tmp_path / "per_expert")
    state = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "fused").mkdir()
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    cfg, params = hf.load(tmp_path / "per_expert")
    fused_cfg, fused_params = hf.load(tmp_path / "fused")
    assert fused_cfg == cfg
    assert_same_tree(fused_params, params)


def test_save_refuses_routing_transformers_cannot_express(tmp_path):
    from tests.support import tiny

    cfg = tiny.qwen3_moe(router_bias_update_rate=1e-3).model
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), models.param_shapes(cfg))
    with pytest.raises(ValueError, match=r"^model.router_bias_update_rate=0.001 has no transformers equivalent"):
        hf.save(tmp_path / "out", cfg, params)
    assert not (tmp_path / "out").exists(), "nothing is written before the refusal"


def test_jaxpar_fields_of_a_loss_free_config_are_kept():
    """Training an HF checkpoint with loss-free balancing (convert --from_hf, init_from_hf): the
    routing options config.json cannot hold come from the run's config, not a refusal to save."""
    from jaxpar.models.families import FAMILIES
    from tests.support import tiny

    mine = tiny.qwen3_moe(scoring_func="sigmoid", router_bias_update_rate=1e-3, capacity_factor=1.0).model
    adapter = FAMILIES["qwen3_moe"].hf
    read = adapter.to_model_config(adapter.to_hf_config(tiny.qwen3_moe().model))  # as from config.json
    merged = hf.with_jaxpar_fields(read, mine)
    assert (merged.scoring_func, merged.router_bias_update_rate, merged.capacity_factor) == ("sigmoid", 1e-3, 1.0)
    assert merged.to_dict() == mine.to_dict()
