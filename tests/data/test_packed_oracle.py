"""An outside oracle for packing: transformers' Llama, run on each document SEPARATELY, against
jaxpar given the same documents packed into rows (segment ids, positions restarting at 0 per
document, padding at the end of each row).

transformers never sees a packed row, a segment id or a mask jaxpar wrote: each document is its
own `input_ids` of its own length, positions 0 .., plain causal attention. So agreement proves
that jaxpar's packing isolates documents (no token attends to another document, RoPE restarts,
no target crosses a boundary, padding is never a target) with no help from jaxpar's own code:
- every token's logits and loss, from jaxpar's forward (`models.apply`, the `xla` attention path);
- the production train step's loss (the `jaxpar_xla` kernel, CPU's "auto") = the mean over the
  real target tokens of transformers' per-token losses, and its step-1 gradients = the gradient of
  that mean in torch (Σ per-document gradients / target count).
Positive control: the same forward with every segment id 1 (segment ids ignored, positions still
restarting) leaves the first document of each row unchanged and moves every later one by far more
than the tolerance.

Mixtral with its router losses on (`mixtral_aux`, aux coefficient 0.5): the auxiliary losses are
token-level statistics, and under packing the tokens are the real ones (segment id > 0: every token
of every document that enters the model; padding is no token). So transformers runs each document
alone, its router logits of every layer are pooled over all documents, and its own
`load_balancing_loss_func` of the pooled logits is the aux loss the packed step must report; the
step's loss = mean cross-entropy over the real targets + 0.5 × that, and its step-1 gradients are
torch's gradient of the same sum. The z-loss (coefficient 0 after `hf.load`, transformers has
none) is the mean over real (token, layer) pairs of logsumexp(router logits)² and each expert's
share of the assignments is counted from torch's top-k, both from the same pooled logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxpar import models  # noqa: E402
from jaxpar.models.options import RunOptions  # noqa: E402
from jaxpar.parallel.context.sequence import segment_positions  # noqa: E402
from jaxpar.parallel.plan import ParallelPlan  # noqa: E402
from jaxpar.parallel.tensor import cross_entropy  # noqa: E402
from jaxpar.train.setup import build  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.hf_oracle import as_jaxpar, hf_model, weights  # noqa: E402
from tests.support.reference import max_relative_error  # noqa: E402

SEQ = 32  # a row holds SEQ + 1 tokens (inputs and, shifted by one, targets)
# Document lengths per row (tokens), each row's sum < SEQ + 1: padding at the end of every row.
ROWS = [(11, 9, 8), (20, 10)]
# Measured: logits 1.3e-6 of their largest, per-token losses 4.9e-7, step loss 1.2e-7, gradients 2.5e-6;
# segment ids ignored: later documents' logits off by 1.2 .. 1.5 of their largest.
TOL = 1e-5


def packed_documents(vocab: int):
    """(batch [G, 2, SEQ+1] built by hand, the documents of each row)."""
    rng = np.random.default_rng(3)
    batch = np.zeros((len(ROWS), 2, SEQ + 1), np.int32)
    docs = []
    for r, lengths in enumerate(ROWS):
        start, row = 0, []
        for s, n in enumerate(lengths, start=1):
            doc = rng.integers(0, vocab, n).astype(np.int32)
            batch[r, 0, start : start + n], batch[r, 1, start : start + n] = doc, s
            row.append((start, doc))
            start += n
        docs.append(row)
    return batch, docs


def hf_alone(model, doc):
    """transformers on one document alone: (logits [n-1, V], per-token losses [n-1], as torch)."""
    ids = torch.as_tensor(doc, dtype=torch.long)[None]
    logits = model(input_ids=ids[:, :-1]).logits[0]
    return logits, torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    model = hf_model("llama_gqa_untied")
    vocab = model.config.vocab_size
    batch, docs = packed_documents(vocab)
    cfg, params = as_jaxpar(model, weights(model), tmp_path_factory.mktemp("weights"))

    # transformers: every document alone; the gradient of the mean over all real targets.
    alone = [[hf_alone(model, doc) for _, doc in row] for row in docs]
    count = sum(len(doc) - 1 for row in docs for _, doc in row)
    total = sum(losses.sum() for row in alone for _, losses in row)
    (total / count).backward()
    hf_grads = as_jaxpar(model, {n: p.grad.numpy() for n, p in model.named_parameters()}, tmp_path_factory.mktemp("grads"))[1]

    # jaxpar's forward on the packed rows (one compile, called with two segment-id arrays).
    tokens = jnp.asarray(batch[:, 0, :-1])
    opts = RunOptions(plan=ParallelPlan(attention="xla"))

    @jax.jit
    def forward(segments):
        logits, _ = models.apply(cfg, params, tokens, opts, segment_positions(segments), segments)
        return logits, cross_entropy(logits, jnp.asarray(batch[:, 0, 1:]))

    # The production train step on the packed batch (one device, fp32, CPU's default attention).
    config = tiny.llama({"global_batch_size": len(ROWS), "seq_len": SEQ})
    config.model = cfg
    program = build(tiny.with_overrides(config, {}), jax.devices()[:1])
    _, metrics, grads = program.step_with_grads(program.init_from_params(params), batch)
    return {
        "batch": batch, "docs": docs, "vocab": vocab, "count": count,
        "alone": [[(l.detach().numpy(), t.detach().numpy()) for l, t in row] for row in alone],
        "hf_loss": float(total.detach()) / count, "hf_grads": hf_grads,
        "packed": jax.device_get(forward(jnp.asarray(batch[:, 1, :-1]))),
        "ignored": jax.device_get(forward(jnp.ones_like(tokens))),
        "step_loss": float(metrics["loss"]), "step_grads": jax.device_get(grads),
    }


def _per_document(o, which):
    """[(row, document index, jaxpar logits [n-1, V], jaxpar losses [n-1], hf logits, hf losses)]."""
    logits, losses = o[which]
    out = []
    for r, row in enumerate(o["docs"]):
        for i, (start, doc) in enumerate(row):
            span = slice(start, start + len(doc) - 1)  # inputs whose target is in the same document
            out.append((r, i, logits[r, span, : o["vocab"]], losses[r, span], *o["alone"][r][i]))
    return out


def test_every_token_equals_its_document_alone_in_transformers(oracle):
    logit_err = max(np.max(np.abs(l - hl)) / np.max(np.abs(hl)) for *_, l, _, hl, _ in _per_document(oracle, "packed"))
    loss_err = max(np.max(np.abs(t - ht)) / np.max(ht) for *_, t, _, ht in _per_document(oracle, "packed"))
    print(f"packed vs transformers alone: logits {logit_err:.1e}, per-token losses {loss_err:.1e} (relative to the largest)")
    assert logit_err <= TOL and loss_err <= TOL
    assert np.all(np.isfinite(oracle["packed"][0]))


def test_train_step_loss_and_gradients_equal_transformers(oracle):
    grad_err = max_relative_error(oracle["step_grads"], oracle["hf_grads"])
    print(f"train step loss {oracle['step_loss']:.7f} vs transformers {oracle['hf_loss']:.7f} over {oracle['count']} "
          f"targets; gradients {grad_err:.1e}")
    assert abs(oracle["step_loss"] - oracle["hf_loss"]) <= TOL * oracle["hf_loss"]
    assert grad_err <= TOL


def test_positive_control_segment_ids_ignored(oracle):
    """Every segment id 1: positions still restart, but later documents attend to earlier ones."""
    gaps = {}
    for r, i, l, _, hl, _ in _per_document(oracle, "ignored"):
        gaps[r, i] = float(np.max(np.abs(l - hl)) / np.max(np.abs(hl)))
    print(f"segment ids ignored: logits off by {gaps}")
    assert all(gaps[r, 0] <= TOL for r in range(len(ROWS))), "a row's first document sees nothing before it"
    assert min(g for (r, i), g in gaps.items() if i > 0) > 1000 * TOL


# The MoE oracle's rows: padding after every row's documents and a row of padding only, so that
# counting padding as tokens would move every router statistic.
MOE_ROWS = [(11, 9, 8), (20, 10), ()]


@pytest.fixture(scope="module")
def moe_oracle(tmp_path_factory):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = hf_model("mixtral_aux")
    hf = model.config
    rng = np.random.default_rng(5)
    batch, docs = np.zeros((len(MOE_ROWS), 2, SEQ + 1), np.int32), []
    for r, lengths in enumerate(MOE_ROWS):
        start = 0
        for s, n in enumerate(lengths, start=1):
            docs.append(rng.integers(0, hf.vocab_size, n).astype(np.int32))
            batch[r, 0, start : start + n], batch[r, 1, start : start + n] = docs[-1], s
            start += n
    cfg, params = as_jaxpar(model, weights(model), tmp_path_factory.mktemp("moe_weights"))

    # transformers: every document alone (all its tokens are inputs in the packed rows: none ends a row).
    outs = [model(input_ids=torch.as_tensor(doc, dtype=torch.long)[None], output_router_logits=True) for doc in docs]
    count = sum(len(doc) - 1 for doc in docs)
    ce = sum(torch.nn.functional.cross_entropy(o.logits[0, :-1], torch.as_tensor(doc[1:], dtype=torch.long), reduction="sum")
             for o, doc in zip(outs, docs)) / count
    pooled = tuple(torch.cat([o.router_logits[layer] for o in outs]) for layer in range(hf.num_hidden_layers))
    aux = load_balancing_loss_func(pooled, hf.num_local_experts, hf.num_experts_per_tok)
    (ce + hf.router_aux_loss_coef * aux).backward()
    hf_grads = as_jaxpar(model, {n: p.grad.numpy() for n, p in model.named_parameters()}, tmp_path_factory.mktemp("moe_grads"))[1]
    logits = torch.stack(pooled).detach()  # [layers, real tokens, E]
    chosen = torch.topk(logits, hf.num_experts_per_tok, dim=-1).indices
    shares = torch.bincount(chosen.reshape(-1), minlength=hf.num_local_experts).double() / chosen.numel()

    config = tiny.mixtral({"global_batch_size": len(MOE_ROWS), "seq_len": SEQ})
    config.model = cfg
    program = build(tiny.with_overrides(config, {}), jax.devices()[:1])
    _, metrics, grads = program.step_with_grads(program.init_from_params(params), batch)
    return {
        "coef": hf.router_aux_loss_coef, "z_coef": cfg.router_z_loss_coef, "hf_ce": float(ce.detach()), "hf_aux": float(aux.detach()),
        "hf_z": float((torch.logsumexp(logits, -1) ** 2).mean()), "hf_shares": shares.numpy(), "hf_grads": hf_grads,
        "metrics": jax.device_get(metrics), "grads": jax.device_get(grads), "padding": int((batch[:, 1, :-1] == 0).sum()),
    }


def test_packed_router_losses_are_over_the_real_tokens(moe_oracle):
    o, m = moe_oracle, moe_oracle["metrics"]
    print(f"aux loss {float(m['aux_loss']):.7f} vs transformers {o['hf_aux']:.7f}; z loss {float(m['z_loss']):.7f} vs "
          f"{o['hf_z']:.7f}; {o['padding']} padding inputs")
    assert o["z_coef"] == 0 and o["padding"] > SEQ  # the z-loss is compared as a metric; padding is there to be miscounted
    assert abs(float(m["aux_loss"]) - o["hf_aux"]) <= TOL * o["hf_aux"]
    assert abs(float(m["z_loss"]) - o["hf_z"]) <= TOL * o["hf_z"]
    np.testing.assert_allclose(np.asarray(m["expert_fraction"]), o["hf_shares"], rtol=0, atol=1e-6)


def test_packed_moe_step_with_router_losses_equals_transformers(moe_oracle):
    o = moe_oracle
    want = o["hf_ce"] + o["coef"] * o["hf_aux"]
    grad_err = max_relative_error(o["grads"], o["hf_grads"])
    print(f"packed MoE step loss {float(o['metrics']['loss']):.7f} vs transformers {want:.7f}; gradients {grad_err:.1e}")
    assert abs(float(o["metrics"]["loss"]) - want) <= TOL * want
    assert grad_err <= TOL
