"""An outside oracle for DPO (`train.objective="dpo"`): the loss, rewards and every parameter's
gradient of jaxpar's train step on a packed batch of preference pairs (`data.format="preference"`,
read from a .jsonl file through the production data pipeline) against transformers' Llama in torch,
each half of each pair run ALONE with labels -100 outside its completion, the sums of completion
log-probabilities as TRL's `get_batch_logps` takes them and the loss as TRL's sigmoid loss with label
smoothing (written here: trl is not a test dependency). The reference model is a second set of
weights (the policy perturbed), so the rewards are not zero.
"""

import copy

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxpar.data.corpus import training_stream  # noqa: E402
from jaxpar.data.packing import Packer  # noqa: E402
from jaxpar.train.setup import build  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.chat import write_records  # noqa: E402
from tests.support.hf_oracle import as_jaxpar, hf_model, weights  # noqa: E402
from tests.support.reference import max_relative_error  # noqa: E402

SEQ, ROWS = 63, 2
BETA, SMOOTHING = 0.5, 0.2
TOL = 1e-5


def words(rng, low, high) -> str:
    return "".join(chr(int(c)) for c in rng.integers(97, 123, int(rng.integers(low, high + 1))))


def pairs(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": words(rng, 3, 9), "chosen": words(rng, 2, 8), "rejected": words(rng, 2, 8)} for _ in range(count)]


def halves(batch):
    """(row, chosen ids, chosen mask, rejected ids, rejected mask) of each packed pair: a segment
    with chosen marks (1) and the next segment, read from the batch alone."""
    for r in range(batch.shape[0]):
        ids, segments, mask = batch[r]
        for s in range(1, segments.max() + 1):
            here = segments == s
            if (mask[here] == 1).any():
                there = segments == s + 1
                yield ids[here], mask[here] == 1, ids[there], mask[there] == 2


def completion_logp(model, ids, mask):
    """TRL's `get_batch_logps`: Σ log p(token) over the completion's targets (labels -100 elsewhere)."""
    ids = torch.as_tensor(ids, dtype=torch.long)[None]
    labels = torch.where(torch.as_tensor(mask)[None], ids, torch.full_like(ids, -100))
    logits = model(input_ids=ids).logits[:, :-1]
    labels = labels[:, 1:]
    picked = torch.gather(logits.log_softmax(-1), 2, labels.clamp(min=0)[..., None])[..., 0]
    return (picked * (labels != -100)).sum()


def trl_sigmoid_loss(pc, pr, rc, rr, beta, eps):
    logits = (pc - pr) - (rc - rr)
    losses = -torch.nn.functional.logsigmoid(beta * logits) * (1 - eps) - torch.nn.functional.logsigmoid(-beta * logits) * eps
    return losses.mean(), beta * (pc - rc), beta * (pr - rr)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_oracle")
    path = write_records(root / "pairs.jsonl", pairs(12, seed=3))
    policy = hf_model("llama_gqa_untied")
    reference = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator) * p.abs().mean())
    cfg, params = as_jaxpar(policy, weights(policy), root / "policy")
    _, ref_params = as_jaxpar(reference, weights(reference), root / "reference")

    config = tiny.llama({"global_batch_size": ROWS, "seq_len": SEQ, "objective": "dpo"})
    config.model = cfg
    config.train.dpo.update(beta=BETA, label_smoothing=SMOOTHING)
    config.data.update(source="text", path=path, format="preference")
    batch = next(Packer(training_stream(config), ROWS, SEQ + 1))
    program = build(config, jax.devices()[:1])
    state = program.init_from_params(params)
    state = state.replace(reference=jax.device_put(ref_params, program.state_shardings.reference))
    _, metrics, grads = program.step_with_grads(state, batch)

    found = list(halves(batch))
    sums = [[completion_logp(m, ids, mask) for m in (policy, reference)] for h in found for ids, mask in (h[:2], h[2:])]
    pc, rc = (torch.stack([s[i] for s in sums[0::2]]) for i in (0, 1))
    pr, rr = (torch.stack([s[i] for s in sums[1::2]]) for i in (0, 1))
    loss, chosen, rejected = trl_sigmoid_loss(pc, pr, rc.detach(), rr.detach(), BETA, SMOOTHING)
    loss.backward()
    loss, chosen, rejected = loss.detach(), chosen.detach(), rejected.detach()
    hf_grads = as_jaxpar(policy, {n: p.grad.numpy() for n, p in policy.named_parameters()}, root / "grads")[1]
    return {
        "pairs": len(found), "metrics": jax.device_get(metrics), "grads": jax.device_get(grads), "hf_grads": hf_grads,
        "hf": {"loss": float(loss), "rewards_chosen": float(chosen.mean()), "rewards_rejected": float(rejected.mean()),
               "rewards_margin": float((chosen - rejected).mean()),
               "rewards_accuracy": float((chosen > rejected).float().mean())},
    }


def test_dpo_step_equals_trl_formula_on_transformers(oracle):
    o, m = oracle, oracle["metrics"]
    assert o["pairs"] >= 4 and int(m["pairs"]) == o["pairs"]
    grad_err = max_relative_error(o["grads"], o["hf_grads"])
    print(f"{o['pairs']} pairs: loss {float(m['loss']):.7f} vs {o['hf']['loss']:.7f}, rewards chosen "
          f"{float(m['rewards_chosen']):.6f} vs {o['hf']['rewards_chosen']:.6f}, gradients {grad_err:.1e}")
    for key, want in o["hf"].items():
        assert abs(float(m[key]) - want) <= TOL * max(1.0, abs(want)), key
    assert 0 < o["hf"]["rewards_accuracy"] < 1  # the rewards tell the pairs apart, both ways
    assert grad_err <= TOL
