"""Conversations and prompt–completion pairs (`data.format`): the assistant mask against transformers'
own (`apply_chat_template(return_assistant_tokens_mask=True)` on the same template with `{% generation %}`
markers), the truncation policy against the template's rendering of the shorter conversation, packing
with a loss-mask channel, and the target weights the train step derives from it.

The loss itself, packed and masked, against transformers' Llama run on each conversation alone with
labels -100 outside the assistant's turns: tests/data/test_chat_oracle.py.
"""

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

from jaxpar.data import formats  # noqa: E402
from jaxpar.data.chat import RecordError, marker_mask, prefix_mask, render_completion, render_conversation  # noqa: E402
from jaxpar.data.documents import DataError, IndexedStream, SpanDocuments  # noqa: E402
from jaxpar.data.formats import RecordFormat, fit_row  # noqa: E402
from jaxpar.data.packing import ListStream, Packer  # noqa: E402
from jaxpar.data.tokenizer import TextTokenizer  # noqa: E402
from jaxpar.parallel.context.sequence import document_batch, target_count  # noqa: E402
from tests.support.chat import (  # noqa: E402
    CHATML_MARKED,
    REWRITES_LAST,
    conversation,
    conversations,
    make_chat_tokenizer,
    tool_conversation,
    write_records,
)
from tests.support.documents import documents_in  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {name: TextTokenizer(make_chat_tokenizer(root / name, template))
            for name, template in {"plain": None, "marked": CHATML_MARKED, "rewrites": REWRITES_LAST}.items()} | {
        "chatml": TextTokenizer(make_chat_tokenizer(root / "chatml"))}


def test_assistant_mask_equals_transformers_generation_mask(tok):
    """Prefix renderings of the plain ChatML template give exactly the mask transformers reads from the
    same template's {% generation %} markers: multi-turn, with and without a system prompt."""
    records = conversations(60, seed=1, max_turns=4)
    assert {len(m) for m in records} >= {2, 3, 8, 9}  # one to four turns, with and without a system prompt
    counted = 0
    for messages in records:
        ours = prefix_mask(tok["chatml"].tokenizer, messages)
        theirs = marker_mask(tok["marked"].tokenizer, messages)
        np.testing.assert_array_equal(ours.ids, theirs.ids)
        np.testing.assert_array_equal(ours.mask, theirs.mask)
        assert ours.turn_ends == theirs.turn_ends == tuple(np.flatnonzero(np.diff(np.append(ours.mask, 0)) < 0) + 1)
        counted += int(ours.mask.sum())
    print(f"{len(records)} conversations, {counted} assistant tokens: equal to transformers' generation mask")
    # What the mask holds: each reply and its end-of-turn token, decoded.
    messages = records[0]
    ours = render_conversation(tok["chatml"].tokenizer, messages)
    said = "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
    assert tok["chatml"].tokenizer.decode(ours.ids[ours.mask == 1]) == said


def test_tool_calls_are_trained_and_tool_results_are_not(tok):
    """An assistant turn that calls a tool (no text) and the tool's result: the prefix mask equals
    transformers' generation mask, and what it holds is exactly the assistant's call and reply."""
    rng = np.random.default_rng(7)
    for _ in range(5):
        messages = tool_conversation(rng)
        ours = prefix_mask(tok["chatml"].tokenizer, messages)
        theirs = marker_mask(tok["marked"].tokenizer, messages)
        np.testing.assert_array_equal(ours.ids, theirs.ids)
        np.testing.assert_array_equal(ours.mask, theirs.mask)
    call = json.dumps(messages[1]["tool_calls"])
    trained = tok["chatml"].tokenizer.decode(ours.ids[ours.mask == 1])
    assert trained == f"<tool_call>{call}</tool_call><|im_end|>\n{messages[3]['content']}<|im_end|>\n"
    assert messages[2]["content"] not in trained, "the tool's result is given, not trained"


def test_template_that_rewrites_earlier_turns_is_refused(tok):
    messages = conversation(np.random.default_rng(0), 2)
    with pytest.raises(RecordError, match="not prefix-stable"):
        render_conversation(tok["rewrites"].tokenizer, messages)
    render_conversation(tok["rewrites"].tokenizer, messages[:2])  # one turn: the last is the only one


@pytest.mark.parametrize("messages,words", [
    ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}], "role 'robot'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": {"name": "f"}}],
     "has tool_calls of type dict, not a non-empty list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "has content of type null"),
    ([{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}], "content of type list"),
    ([{"role": "user"}], "must be an object with 'role' and 'content'"),
    ("hello", "non-empty list"),
    ([], "non-empty list"),
])
def test_bad_conversations_are_one_line(tok, messages, words):
    with pytest.raises(RecordError, match=words):
        render_conversation(tok["chatml"].tokenizer, messages)


def test_prompt_completion_masks_the_prompt(tok):
    t = tok["chatml"]
    text = render_completion(t, "the quick brown", " fox jumps")
    prompt, completion = t.encode_text("the quick brown"), t.encode_text(" fox jumps")
    np.testing.assert_array_equal(text.ids, prompt + completion + [t.tokenizer.eos_token_id])
    np.testing.assert_array_equal(text.mask, [0] * len(prompt) + [1] * (len(completion) + 1))
    user, reply = [{"role": "user", "content": "the quick"}], [{"role": "assistant", "content": "brown fox"}]
    chat = render_completion(t, user, reply)
    whole = prefix_mask(t.tokenizer, user + reply)  # the same pair as a conversation
    np.testing.assert_array_equal(chat.ids, whole.ids)
    np.testing.assert_array_equal(chat.mask, whole.mask)
    with pytest.raises(RecordError, match="both be text or both be lists"):
        render_completion(t, "a", reply)
    with pytest.raises(RecordError, match="no chat template"):
        render_completion(tok["plain"], user, reply)


def _format(t, width):
    formats.SEEN.clear()  # the 1st of each outcome is logged: earlier tests in this process counted theirs
    return RecordFormat("chat", t, width, "data.path")


def test_truncation_drops_whole_trailing_turns(tok, caplog):
    """A conversation longer than a row keeps its longest run of whole turns that ends with a reply:
    exactly the template's rendering of the shorter conversation."""
    t = tok["chatml"]
    messages = conversation(np.random.default_rng(4), 3, system=True)
    whole = prefix_mask(t.tokenizer, messages)
    width = whole.turn_ends[1] + 3  # two turns fit, the third does not
    with caplog.at_level(logging.WARNING):
        doc = _format(t, width).document({"messages": messages}, lambda: "data.path: a.jsonl line 9")
    shorter = prefix_mask(t.tokenizer, messages[:5])  # system, then two exchanges
    np.testing.assert_array_equal(doc, np.stack([shorter.ids, shorter.mask], 1))
    assert "a.jsonl line 9: a record of" in caplog.text and "trailing turns that do not fit are dropped" in caplog.text


def test_truncation_cuts_a_first_reply_longer_than_the_row_and_skips_a_long_prompt(tok, caplog):
    t = tok["chatml"]
    messages = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": " ".join(["dog"] * 40)}]
    whole = prefix_mask(t.tokenizer, messages)
    start = int(np.argmax(whole.mask))
    fmt = _format(t, start + 5)
    with caplog.at_level(logging.WARNING):
        doc = fmt.document({"messages": messages}, lambda: "here")
        np.testing.assert_array_equal(doc, np.stack([whole.ids, whole.mask], 1)[: start + 5])
        assert "the reply is cut" in caplog.text
        skipped = _format(t, start).document({"messages": messages}, lambda: "here")  # no assistant token fits
    assert skipped.shape == (0, 2) and fmt.counts == {"cut": 1}
    fitted, outcome = fit_row(whole, len(whole.ids))
    assert outcome is None and fitted is whole


def test_packed_chat_batch_weights_only_assistant_targets(tok):
    """Conversations packed as documents: a third channel carries the mask; the train step's weights
    count exactly the assistant targets, never across a conversation or in padding."""
    t = tok["chatml"]
    rendered = [prefix_mask(t.tokenizer, m) for m in conversations(12, seed=2, max_turns=2, high=5)]
    docs = [np.stack([r.ids, r.mask], 1) for r in rendered]
    width = max(len(r.ids) for r in rendered) + 7
    batch = next(Packer(ListStream(docs), 4, width))
    assert batch.shape == (4, 3, width)
    packed = documents_in(batch)
    assert len(packed) >= 5
    expected = 0
    for row in batch:
        for seg in np.unique(row[1][row[1] > 0]):
            ids, mask = row[0][row[1] == seg], row[2][row[1] == seg]
            match = next(r for r in rendered if len(r.ids) == len(ids) and np.array_equal(r.ids, ids))
            np.testing.assert_array_equal(mask, match.mask)
            expected += int(mask[1:].sum())
    weights = np.asarray(document_batch(jnp.asarray(batch))["weights"])
    counts = (batch[:, 1, :-1] == batch[:, 1, 1:]) & (batch[:, 1, :-1] > 0) & (batch[:, 2, 1:] > 0)
    np.testing.assert_array_equal(weights > 0, counts)
    assert int(target_count(jnp.asarray(batch))) == expected == int(counts.sum())
    np.testing.assert_allclose(weights.sum(), weights.size, rtol=1e-6)  # mean(loss · weight) = Σ loss / count


def test_plain_text_batches_are_as_before():
    """A stream of plain documents packs two channels, byte for byte what the packer always packed."""
    docs = [np.arange(n, dtype=np.int32) + 3 for n in (5, 9, 4, 12, 3)]
    batch = next(Packer(ListStream(docs), 2, 16))
    assert batch.shape == (2, 2, 16)
    mixed = next(Packer(ListStream(docs + [np.stack([np.arange(4), np.array([0, 0, 1, 1])], 1)]), 2, 16))
    assert mixed.shape == (2, 3, 16)
    np.testing.assert_array_equal(mixed[:, :2], batch)  # text documents in a masked batch: every token counts
    np.testing.assert_array_equal(mixed[:, 2], (batch[:, 1] > 0).astype(np.int32))


def test_jsonl_chat_records_read_with_file_and_line(tok, tmp_path):
    records = [{"messages": m} for m in conversations(6, seed=5)]
    records[3] = {"messages": [{"role": "user", "content": "hi"}]}
    path = write_records(tmp_path / "chat.jsonl", records)
    docs = SpanDocuments([path], tok["chatml"], per_line=False, text_field="text",
                         record_format=_format(tok["chatml"], 512))
    first = docs[0]
    expected = prefix_mask(tok["chatml"].tokenizer, records[0]["messages"])
    np.testing.assert_array_equal(first, np.stack([expected.ids, expected.mask], 1))
    with pytest.raises(DataError, match=r"data.path: .*chat.jsonl line 4: the conversation has no assistant turn"):
        docs[3]
    stream = IndexedStream(docs, seed=0, train=False, channels=3)
    assert len([next(stream) for _ in range(3)]) == 3
