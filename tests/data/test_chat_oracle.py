"""An outside oracle for chat fine-tuning: the loss and gradients of jaxpar's train step on a packed
batch of conversations (`data.format="chat"`, read from a .jsonl file through the production data
pipeline) against transformers' Llama run on each conversation ALONE with labels -100 outside the
assistant's turns, the conversation and its labels rendered by transformers itself
(`apply_chat_template(return_assistant_tokens_mask=True)` on the same ChatML template with
{% generation %} markers; jaxpar's tokenizer folder has the template without them, so jaxpar finds the
assistant's tokens its own way, by prefix renderings).

transformers' own loss of a conversation (`model(input_ids, labels=...)`: the mean over its
assistant targets) times its target count, summed over the conversations of the batch and divided by
their total count, is the number the step must report; its gradient, in torch, the step's gradients.
Conversations longer than a row lose their last exchanges (the documented policy: here the oracle
drops them from the messages and lets transformers render what is left). The eval step on an
eval.path of the same format equals the same mean over every conversation of the eval file.
Measured: step loss 7.4955459 vs 7.4955444 over 44 assistant targets, gradients 7.1e-6 of their
largest; eval 7.5779423 vs 7.5779419 over 138 targets.
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxpar.data.corpus import eval_batches, training_stream  # noqa: E402
from jaxpar.data.packing import Packer  # noqa: E402
from jaxpar.train.eval import eval_loss  # noqa: E402
from jaxpar.train.setup import build  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.chat import CHATML, CHATML_MARKED, conversations, make_chat_tokenizer, write_records  # noqa: E402
from tests.support.documents import documents_in  # noqa: E402
from tests.support.hf_oracle import as_jaxpar, hf_model, weights  # noqa: E402
from tests.support.reference import max_relative_error  # noqa: E402

SEQ, ROWS = 127, 2  # rows of 128 tokens: two to four short conversations each
TOL = 1e-5


def hf_conversation(model, tokenizer, messages):
    """(transformers' loss summed over the conversation's assistant targets, their count, its ids), in
    torch; a conversation longer than a row loses its last exchanges until it fits (the documented policy)."""
    while True:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        if len(out["input_ids"]) <= SEQ + 1:
            break
        assert sum(m["role"] == "assistant" for m in messages) > 1, "the oracle's records keep a whole first exchange"
        messages = messages[:-2]
    ids = torch.as_tensor(out["input_ids"])[None]
    labels = torch.where(torch.as_tensor(out["assistant_masks"])[None] > 0, ids, torch.full_like(ids, -100))
    count = int((labels[0, 1:] != -100).sum())
    return model(input_ids=ids, labels=labels).loss * count, count, tuple(out["input_ids"])


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_oracle")
    ours, theirs = make_chat_tokenizer(root / "chatml", CHATML, 300), make_chat_tokenizer(root / "marked", CHATML_MARKED, 300)
    records = conversations(24, seed=7, max_turns=2, high=3)
    path = write_records(root / "train.jsonl", [{"messages": m} for m in records])
    evals = conversations(9, seed=8, max_turns=3, high=3)
    eval_path = write_records(root / "eval.jsonl", [{"messages": m} for m in evals])

    model = hf_model("llama_gqa_untied")
    cfg, params = as_jaxpar(model, weights(model), root / "weights")
    config = tiny.llama({"global_batch_size": ROWS, "seq_len": SEQ})
    config.model = cfg
    config.data.update(source="text", path=path, format="chat", tokenizer=ours)
    config.eval.path = eval_path
    batch = next(Packer(training_stream(config), ROWS, SEQ + 1))
    program = build(tiny.with_overrides(config, {}), jax.devices()[:1])
    _, metrics, grads = program.step_with_grads(program.init_from_params(params), batch)
    step = jax.jit(lambda p, b: eval_loss(p, b, model_config=cfg, opts=program.opts))
    evaluated = [jax.device_get(step(params, b)) for b in eval_batches(config)]

    # transformers: each conversation of the batch alone, found by its token ids.
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(theirs)
    alone = {ids: (loss, count) for loss, count, ids in (hf_conversation(model, tokenizer, m) for m in records)}
    packed = [tuple(int(i) for i in doc) for doc in documents_in(batch)]
    assert set(packed) <= set(alone), "a packed conversation is not one transformers renders"
    total, count = sum(alone[ids][0] for ids in packed), sum(alone[ids][1] for ids in packed)
    (total / count).backward()
    hf_grads = as_jaxpar(model, {n: p.grad.numpy() for n, p in model.named_parameters()}, root / "grads")[1]
    with torch.no_grad():
        ev = [hf_conversation(model, tokenizer, m)[:2] for m in evals]
    rendered = {tuple(tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"]) for m in records}
    segments = [batch[r, 2, batch[r, 1] == s] for r in range(ROWS) for s in range(1, batch[r, 1].max() + 1)]
    return {
        "batch": batch, "conversations": len(packed), "shortened": len(set(packed) - rendered),
        "multi_turn": sum(np.count_nonzero(np.diff(np.append(mask, 0)) < 0) > 1 for mask in segments),
        "count": count, "hf_loss": float(total.detach()) / count, "hf_grads": hf_grads,
        "step_loss": float(metrics["loss"]), "step_grads": jax.device_get(grads),
        "eval": sum(float(lo) * int(c) for lo, c in evaluated) / sum(int(c) for _, c in evaluated),
        "eval_count": sum(int(c) for _, c in evaluated),
        "hf_eval": float(sum(lo for lo, _ in ev)) / sum(c for _, c in ev), "hf_eval_count": sum(c for _, c in ev),
    }


@pytest.mark.slow
def test_masked_step_loss_and_gradients_equal_transformers_per_conversation(oracle):
    o = oracle
    assert o["batch"].shape == (ROWS, 3, SEQ + 1) and o["conversations"] > ROWS  # a row holds several
    assert o["multi_turn"] > 0
    grad_err = max_relative_error(o["step_grads"], o["hf_grads"])
    print(f"{o['conversations']} conversations packed ({o['multi_turn']} multi-turn, {o['shortened']} shortened), "
          f"{o['count']} assistant targets: step loss {o['step_loss']:.7f} vs "
          f"transformers {o['hf_loss']:.7f}; gradients {grad_err:.1e}")
    assert abs(o["step_loss"] - o["hf_loss"]) <= TOL * o["hf_loss"]
    assert grad_err <= TOL


@pytest.mark.slow
def test_eval_of_a_chat_file_equals_transformers(oracle):
    o = oracle
    print(f"eval: {o['eval_count']} assistant targets, loss {o['eval']:.7f} vs transformers {o['hf_eval']:.7f}")
    assert o["eval_count"] == o["hf_eval_count"]
    assert abs(o["eval"] - o["hf_eval"]) <= TOL * o["hf_eval"]
