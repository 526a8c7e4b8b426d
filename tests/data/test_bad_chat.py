"""The probe's chat and prompt–completion inputs (`data.format`): each bad input through scripts/train.py's
`main`, refused before anything is compiled or written with one line naming the key and (where a record
is at fault) the file and line the case planted (tests/train/probe.py checks the contract)."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from tests.support.chat import REWRITES_LAST, conversations, make_chat_tokenizer  # noqa: E402
from tests.train.probe import Probe  # noqa: E402

VOCAB = "--config.model.vocab_size=384"  # the chat tokenizer's 300 ids, padded
ROW = "--config.train.seq_len=64"  # rows that hold the probe's conversations


class ChatProbe(Probe):
    def __init__(self, root, capsys, monkeypatch, tokenizers):
        super().__init__(root, capsys, monkeypatch)
        self.tokenizers = tokenizers

    def chats(self, name: str, bad: dict | None = None, count: int = 40) -> str:
        """A jsonl file of `count` conversations; `bad` maps a 1-based line number to the record put there."""
        lines = [json.dumps({"messages": m}) for m in conversations(count, seed=2)]
        for number, record in (bad or {}).items():
            lines[number - 1] = record if isinstance(record, str) else json.dumps(record)
        return self.write(name, "\n".join(lines) + "\n")

    def chat_folder(self) -> str:
        self.chats("docs/a.jsonl")
        self.write("docs/notes.txt", "plain text")
        return str(self.root / "docs")

    def chat(self, path: str, *extra: str, fmt: str = "chat", tokenizer: str = "chatml", source: str = "text") -> tuple:
        folder = f"--config.data.tokenizer={self.tokenizers[tokenizer]}" if tokenizer else "--config.data.tokenizer="
        return (f"--config.data.source={source}", f"--config.data.path={path}", f"--config.data.format={fmt}", folder, VOCAB, ROW,
                *extra)


def _role(i):
    return {"line": i, "messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"},
                         {"role": "assistant", "content": "y"}]}


NO_ASSISTANT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
CASES = [
    ("format_unknown", lambda t: (t.chat(t.chats("a.jsonl"), fmt="sharegpt"), "data.format='sharegpt' is not one of")),
    ("chat_without_tokenizer", lambda t: (t.chat(t.chats("a.jsonl"), tokenizer=""), "data.format='chat' renders conversations")),
    ("chat_tokenizer_without_template", lambda t: (t.chat(t.chats("a.jsonl"), tokenizer="plain"), "has no chat template")),
    ("chat_template_not_prefix_stable", lambda t: (t.chat(t.chats("a.jsonl"), tokenizer="rewrites"), "is not prefix-stable")),
    ("chat_from_a_token_file", lambda t: (t.chat(t.tokens("a.bin", [5] * 600), source="tokens"), "reads records")),
    ("chat_folder_with_text", lambda t: (t.chat(t.chat_folder()), "notes.txt is not a .jsonl file")),
    ("chat_unknown_role", lambda t: (t.chat(t.chats("a.jsonl", bad={4: _role(4)})), "a.jsonl line 4: message 1 has role 'robot'")),
    ("chat_no_assistant", lambda t: (t.chat(t.chats("a.jsonl", bad={6: NO_ASSISTANT})), "a.jsonl line 6: the conversation has no "
                                                                                         "assistant turn")),
    ("chat_messages_not_a_list", lambda t: (t.chat(t.chats("a.jsonl", bad={3: {"messages": "hi"}})),
                                            "line 3: 'messages' must be a non-empty list")),
    ("chat_no_messages", lambda t: (t.chat(t.chats("a.jsonl", bad={2: {"text": "hi"}})), "a.jsonl line 2 has no 'messages' field")),
    ("chat_content_not_text", lambda t: (t.chat(t.chats("a.jsonl", bad={5: {"messages": [{"role": "user", "content": 3}]}})),
                                         "line 5: message 0 (user) has content of type int")),
    ("chat_not_json", lambda t: (t.chat(t.chats("a.jsonl", bad={7: "{oops"})), "a.jsonl line 7 is not a JSON record")),
    ("chat_datasets_unknown_role", lambda t: (t.chat(t.chats("a.jsonl", bad={4: _role(4)}), source="datasets"),
                                              "a.jsonl line 4: message 1 has role 'robot'")),
    ("chat_eval_no_assistant", lambda t: (t.chat(t.chats("a.jsonl"), f"--config.eval.path={t.chats('e.jsonl', bad={2: NO_ASSISTANT})}"),
                                          "e.jsonl line 2: the conversation has no assistant turn")),
    ("chat_rows_too_short", lambda t: (t.chat(t.chats("a.jsonl"), "--config.train.seq_len=8"),
                                       "holds no record with a target in a row of train.seq_len+1=9 tokens")),
    ("completion_mixed_kinds", lambda t: (t.chat(t.write("p.jsonl", '{"prompt": "hi", "completion": [{"role": "assistant", '
                                                                    '"content": "x"}]}\n' * 3), fmt="prompt_completion"),
                                          "p.jsonl line 1: 'prompt' and 'completion' must both be text or both be lists")),
    ("completion_missing", lambda t: (t.chat(t.write("p.jsonl", '{"prompt": "hi"}\n'), fmt="prompt_completion"),
                                      "p.jsonl line 1 has no 'completion' field")),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_probe_tokenizers")
    return {"chatml": make_chat_tokenizer(root / "chatml", vocab_size=300),
            "plain": make_chat_tokenizer(root / "plain", None, vocab_size=300),
            "rewrites": make_chat_tokenizer(root / "rewrites", REWRITES_LAST, vocab_size=300)}


def test_the_table_names_each_case_once():
    assert len({c[0] for c in CASES}) == len(CASES) and np.all([callable(c[1]) for c in CASES])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_chat_data_is_one_line_before_anything_is_written(case, tmp_path, capsys, monkeypatch, tokenizers):
    t = ChatProbe(tmp_path, capsys, monkeypatch, tokenizers)
    extra, expected = case[1](t)
    t.refused("train", t.train(*extra), expected)
