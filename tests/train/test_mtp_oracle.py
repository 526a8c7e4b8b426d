"""Multi-token prediction's loss and gradients against the same modules composed in torch from
transformers' own pieces: DeepSeek-V3's decoder layer (`DeepseekV3DecoderLayer`: MLA and a routed MoE
block) inside transformers' `MtpLayer` (enorm, hnorm, eh_proj over [embedding; hidden]) and
`DeepseekV3RMSNorm` as each depth's head norm, on top of transformers' `DeepseekV3ForCausalLM`.

Depth k at position i combines the previous depth's output (the main model's last layer output,
before its final norm, at k = 1) with the embedding of token i + k and predicts token i + k + 1 with
the shared LM head; each depth's loss is summed over the positions whose target exists and
divided by the main loss's count (DeepSeek-V3 eq. 24: 1 / T); the step's loss is the main loss +
train.mtp_loss_weight × the depths' mean. The weights reach jaxpar through its own reader, in
DeepSeek's checkpoint layout (the MTP module of depth d is layer num_hidden_layers + d).

Packed documents: torch runs each document alone (its own input_ids, positions from 0, nothing of
another document anywhere), so agreement shows that no depth of the packed step reads or predicts
across a document boundary; the per-depth losses are over the real targets of the whole batch.
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.modeling_layers import MtpLayer  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm  # noqa: E402

from jaxpar.train.setup import build  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.hf_models import deepseek_config, randomized  # noqa: E402
from tests.support.hf_oracle import as_jaxpar, randomize_selection_biases  # noqa: E402
from tests.support.reference import max_relative_error  # noqa: E402

DEPTH, WEIGHT = 2, 0.3
ROWS, SEQ = 3, 16
# Documents per packed row (lengths; padding after each row's last one).
PACKED = [(7, 6), (12,), (5, 4, 3)]
TOL = 1e-5


class Reference(torch.nn.Module):
    """transformers' DeepSeek-V3 and DEPTH prediction modules of transformers' own pieces."""

    def __init__(self):
        super().__init__()
        config = deepseek_config("q_lora_yarn_groups", num_nextn_predict_layers=DEPTH)
        torch.manual_seed(0)
        self.main = transformers.DeepseekV3ForCausalLM(config)
        layers = config.num_hidden_layers
        # layer_idx past first_k_dense_replace: a routed block, as transformers builds MTP blocks.
        self.modules_ = torch.nn.ModuleList(
            MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layers + d, use_post_norm=False) for d in range(DEPTH)
        )
        self.head_norms = torch.nn.ModuleList(DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps) for _ in range(DEPTH))
        randomized(self)
        randomize_selection_biases(self)

    def sums(self, ids):
        """(main CE sum, per-depth CE sums over the targets that exist) of rows ids [B, S+1] run whole."""
        inputs, targets = ids[:, :-1], ids[:, 1:]
        rows, length = inputs.shape
        seen = {}
        hook = self.main.model.layers[-1].register_forward_hook(lambda m, i, out: seen.setdefault("h", out))
        logits = self.main(input_ids=inputs).logits
        hook.remove()
        main = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        positions = torch.arange(length)[None].expand(rows, length)
        h = seen["h"]
        rotary = self.main.model.rotary_emb(h, positions)
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        depths = []
        for d, (module, norm) in enumerate(zip(self.modules_, self.head_norms)):
            ahead = torch.nn.functional.pad(targets[:, d:], (0, d))  # token i + d + 1
            later = torch.nn.functional.pad(targets[:, d + 1 :], (0, d + 1))  # token i + d + 2
            h = module(self.main.model.embed_tokens(ahead), h, position_embeddings=rotary, attention_mask=mask,
                       position_ids=positions, cache=None)
            ce = torch.nn.functional.cross_entropy(self.main.lm_head(norm(h)).flatten(0, 1), later.flatten(), reduction="none")
            exists = (torch.arange(length) < length - d - 1)[None].expand(rows, length).flatten()
            depths.append((ce * exists).sum())
        return main, depths

    def checkpoint(self, grads: bool = False) -> dict:
        """DeepSeek-layout tensors (or their gradients; zeros for the selection biases, model state)."""
        def value(t, param):
            if not grads:
                return t.detach().numpy().copy()
            return param.grad.numpy() if param is not None else np.zeros(t.shape, np.float32)

        def named(module, prefix=""):
            params = dict(module.named_parameters())
            return {prefix + n: value(t, params.get(n)) for n, t in module.state_dict().items()}

        tensors = named(self.main)
        layers = self.main.config.num_hidden_layers
        for d, (module, norm) in enumerate(zip(self.modules_, self.head_norms)):
            prefix = f"model.layers.{layers + d}."
            tensors.update({k.replace("mtp_block.", ""): v for k, v in named(module, prefix).items()})
            tensors[prefix + "shared_head.norm.weight"] = named(norm)["weight"]
        return tensors


def jaxpar_step(reference, batch, directory):
    cfg, params = as_jaxpar(reference.main, reference.checkpoint(), directory)
    assert cfg.num_nextn_predict_layers == DEPTH
    config = tiny.deepseek_v3({"global_batch_size": batch.shape[0], "seq_len": batch.shape[-1] - 1, "mtp_loss_weight": WEIGHT})
    config.model = cfg
    program = build(tiny.with_overrides(config, {}), jax.devices()[:1])
    _, metrics, grads = program.step_with_grads(program.init_from_params(params), batch)
    return jax.device_get(metrics), jax.device_get(grads)


def compare(reference, loss, depths, metrics, grads, directory):
    loss.backward()
    expected = as_jaxpar(reference.main, reference.checkpoint(grads=True), directory)[1]
    err = max_relative_error(grads, expected)
    mtp = np.asarray([float(d.detach()) for d in depths])
    print(f"loss {float(metrics['loss']):.7f} vs torch {float(loss.detach()):.7f}; depths {metrics['mtp_loss']} vs {mtp}; "
          f"gradients {err:.1e} (relative to each leaf's largest)")
    assert abs(float(metrics["loss"]) - float(loss.detach())) <= TOL * float(loss.detach())
    np.testing.assert_allclose(metrics["mtp_loss"], mtp, rtol=TOL)
    assert err <= TOL
    assert np.max(np.abs(expected["mtp"]["eh_proj"])) > 0 and np.max(np.abs(grads["mtp"]["block"]["mlp"]["router"])) > 0


def test_prediction_loss_and_gradients_equal_torch(tmp_path):
    reference = Reference().train()
    rows = np.random.default_rng(1).integers(0, reference.main.config.vocab_size, (ROWS, SEQ + 1)).astype(np.int32)
    main, depths = reference.sums(torch.as_tensor(rows, dtype=torch.long))
    count = ROWS * SEQ
    depths = [d / count for d in depths]
    loss = main / count + WEIGHT * sum(depths) / DEPTH
    metrics, grads = jaxpar_step(reference, rows, tmp_path / "weights")
    compare(reference, loss, depths, metrics, grads, tmp_path / "grads")


@pytest.mark.slow
def test_packed_prediction_never_crosses_a_document(tmp_path):
    reference = Reference().train()
    rng = np.random.default_rng(2)
    batch, docs = np.zeros((len(PACKED), 2, SEQ + 1), np.int32), []
    for r, lengths in enumerate(PACKED):
        start = 0
        for s, n in enumerate(lengths, start=1):
            docs.append(rng.integers(0, reference.main.config.vocab_size, n).astype(np.int32))
            batch[r, 0, start : start + n], batch[r, 1, start : start + n] = docs[-1], s
            start += n
    alone = [reference.sums(torch.as_tensor(doc[None], dtype=torch.long)) for doc in docs]
    count = sum(len(doc) - 1 for doc in docs)
    depths = [sum(a[1][d] for a in alone) / count for d in range(DEPTH)]
    loss = sum(a[0] for a in alone) / count + WEIGHT * sum(depths) / DEPTH
    metrics, grads = jaxpar_step(reference, batch, tmp_path / "weights")
    compare(reference, loss, depths, metrics, grads, tmp_path / "grads")
