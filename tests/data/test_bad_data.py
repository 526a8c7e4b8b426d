"""The probe's data sources, record files, token files and tokenizers: each bad input through
scripts/train.py's `main`, in this process, refused before anything is compiled or written with one
line naming the key and (where one is at fault) the file and line (`tests/train/probe.py` checks
the contract). The bad record sits where the case planted it, so the line number the message names
is checked against the file as written."""

import json

import pytest

from tests.train.probe import Probe, tokenizer_folder

ENOUGH = 16 * 17 * 2  # tokens for two global batches of 16 x (16 + 1)
NOT_UTF8 = b'{"text": "caf\xe9 au lait"}'  # Latin-1: byte 13 of the line is e9


def data(source: str, path: str, *extra: str) -> tuple:
    return (f"--config.data.source={source}", f"--config.data.path={path}", *extra)


def tokens(t, name, ids=None, dtype="uint16", read_as=None, **kw):
    """Flags training on a token file of `ids` written as `dtype` (read as `read_as`, default the same)."""
    path = t.tokens(name, [5] * ENOUGH if ids is None else ids, dtype, **kw)
    return data("tokens", path, f"--config.data.token_dtype={read_as or dtype}")


# (id, make(t) -> (train.py flags, words the one line must hold))
CASES = [
    # -- record files read by the text source (.jsonl: one document per record)
    ("jsonl_not_utf8", lambda t: (data("text", t.records("a.jsonl", bad={21: NOT_UTF8})),
                                  "a.jsonl line 21 is not UTF-8 (byte 13 of the line is e9)")),
    ("jsonl_not_json", lambda t: (data("text", t.records("a.jsonl", bad={21: b"{not json"})), "a.jsonl line 21 is not a JSON record")),
    ("jsonl_truncated_last_line", lambda t: (data("text", t.write("a.jsonl", t.records_text(40) + b'{"text": "cut sh')),
                                             "a.jsonl line 41 is not a JSON record")),
    ("jsonl_no_field", lambda t: (data("text", t.records("a.jsonl", bad={21: b'{"body": "x"}'})), "a.jsonl line 21 has no 'text' field")),
    ("jsonl_list_text", lambda t: (data("text", t.records("a.jsonl", bad={21: b'{"text": ["a", "b"]}'})),
                                   "a.jsonl line 21: field 'text' is list, not text")),
    ("jsonl_number_text", lambda t: (data("text", t.records("a.jsonl", bad={3: b'{"text": 7}'})), "line 3: field 'text' is int")),
    ("jsonl_null_text", lambda t: (data("text", t.records("a.jsonl", bad={5: b'{"text": null}'})), "line 5 has no 'text' field")),
    ("jsonl_array_record", lambda t: (data("text", t.records("a.jsonl", bad={2: b'["text", "x"]'})), "line 2 has no 'text' field")),
    ("jsonl_in_a_text_folder", lambda t: (data("text", t.folder_with_bad_jsonl()), "b.jsonl line 4 is not a JSON record")),
    ("text_field_other", lambda t: (data("text", t.records("a.jsonl"), "--config.data.text_field=body"), "line 1 has no 'body' field")),
    # -- the datasets source (jsonl / json / parquet / arrow through Hugging Face datasets)
    ("datasets_not_utf8", lambda t: (data("datasets", t.records("a.jsonl", bad={21: NOT_UTF8})), "a.jsonl line 21 is not UTF-8")),
    ("datasets_not_json", lambda t: (data("datasets", t.records("a.jsonl", bad={21: b"{not json"})), "a.jsonl line 21 is not a JSON")),
    ("datasets_no_field", lambda t: (data("datasets", t.records("a.jsonl", bad={21: b'{"body": "x"}'})),
                                     "a.jsonl line 21 has no 'text' field")),
    ("datasets_list_text", lambda t: (data("datasets", t.records("a.jsonl", bad={21: b'{"text": [1]}'})), "line 21: field 'text' is list")),
    ("datasets_empty_file", lambda t: (data("datasets", t.write("e.jsonl", b"")), "e.jsonl holds no record")),
    ("datasets_blank_file", lambda t: (data("datasets", t.write("e.jsonl", b"\n\n  \n")), "e.jsonl holds no record")),
    ("datasets_empty_folder", lambda t: (data("datasets", t.folder("empty")), "matches no file")),
    ("datasets_mixed_folder", lambda t: (data("datasets", t.mixed_folder()), "mixes json and parquet files")),
    ("datasets_glob_with_txt", lambda t: (data("datasets", t.glob_with_txt()), "matches files of unknown format .txt")),
    ("datasets_glob_no_match", lambda t: (data("datasets", str(t.root / "nothing*.jsonl")), "matches no file")),
    ("datasets_empty_in_folder", lambda t: (data("datasets", t.folder_with_empty_jsonl()), "b.jsonl holds no record")),
    ("parquet_no_field", lambda t: (data("datasets", t.parquet("a.parquet", {"body": ["x y z"] * 20})),
                                    "the records of", )),
    ("parquet_int_field", lambda t: (data("datasets", t.parquet("a.parquet", {"text": list(range(20))})), "field 'text' holds int64")),
    ("parquet_null_text", lambda t: (data("datasets", t.parquet("a.parquet", {"text": ["a b c d"] * 9 + [None] + ["e f"] * 10})),
                                     "a.parquet record 10 has no 'text' field")),
    ("parquet_garbage", lambda t: (data("datasets", t.write("a.parquet", b"not a parquet file at all" * 10)), "a.parquet")),
    ("arrow_garbage", lambda t: (data("datasets", t.write("a.arrow", b"\x00\x01 not arrow" * 10)), "a.arrow")),
    ("json_array_of_numbers", lambda t: (data("datasets", t.write("a.json", b"[1, 2, 3]")), "a.json")),
    # -- plain text and the settings
    ("text_documents", lambda t: (data("text", t.records("a.jsonl"), "--config.data.text_documents=para"),
                                  "data.text_documents='para'")),
    ("text_field_empty", lambda t: (data("text", t.records("a.jsonl"), "--config.data.text_field="), "data.text_field is empty")),
    ("eos_id_beyond_vocab", lambda t: (data("text", t.records("a.jsonl"), "--config.data.eos_id=300"), "data.eos_id=300")),
    ("eos_id_below", lambda t: (data("text", t.records("a.jsonl"), "--config.data.eos_id=-2"), "data.eos_id=-2")),
    ("stdlib_no_bytes", lambda t: (("--config.data.max_corpus_bytes=0",), "data.max_corpus_bytes=0 must be positive")),
    ("tokens_is_a_folder", lambda t: (data("tokens", t.folder("adir", ".keep")), "is not a file")),
    ("path_empty", lambda t: (data("tokens", ""), "data.path is empty but data.source='tokens' needs it")),
    # -- token files and their sidecars
    ("sidecar_dtype", lambda t: (tokens(t, "a.bin", [5] * ENOUGH * 2, read_as="uint32", sidecar={}, offsets=[0, ENOUGH * 2]),
                                 "data.token_dtype='uint32' but")),
    ("sidecar_vocab_below_ids", lambda t: (tokens(t, "a.bin", [5] * ENOUGH + [200], sidecar={"vocab_size": 100}),
                                           "holds token id 200 at position 544, not below the vocab_size=100 its sidecar")),
    ("sidecar_not_json", lambda t: (data("tokens", t.tokens_beside("a.bin.json", b"{dtype")), "has an unreadable sidecar")),
    ("sidecar_no_count", lambda t: (data("tokens", t.tokens_beside("a.bin.json", b'{"dtype": "uint16", "vocab_size": 256}')),
                                    "has an unreadable sidecar")),
    ("sidecar_size", lambda t: (tokens(t, "a.bin", sidecar={"num_tokens": 9}), "says 9 uint16 tokens; regenerate it")),
    ("offsets_garbage", lambda t: (data("tokens", t.tokens_beside("a.bin.offsets.npy", b"garbage")), "has an unreadable offsets sidecar")),
    ("offsets_short", lambda t: (tokens(t, "a.bin", offsets=[0, 10]), "does not cut its 544 tokens into documents")),
    ("tokens_negative", lambda t: (tokens(t, "a.bin", [5] * ENOUGH + [-1], "int32"), "holds negative token id -1 at position 544")),
    ("tokens_eos_beyond", lambda t: (tokens(t, "a.bin") + ("--config.data.eos_id=256",), "data.eos_id=256")),
    # -- tokenizers
    ("tokenizer_is_a_file", lambda t: (data("text", t.records("a.jsonl"), f"--config.data.tokenizer={t.write('tok.txt', 'x')}"),
                                       "data.tokenizer=")),
    ("tokenizer_empty_folder", lambda t: (data("text", t.records("a.jsonl"), f"--config.data.tokenizer={t.folder('tok', '.keep')}"),
                                          "tok")),
    ("tokenizer_broken_json", lambda t: (data("text", t.records("a.jsonl"), f"--config.data.tokenizer={t.broken_tokenizer()}"),
                                         "tokenizer")),
    ("tokenizer_then_bad_record", lambda t: (data("datasets", t.records("a.jsonl", bad={7: b'{"text": {}}'}),
                                                  f"--config.data.tokenizer={t.tokenizer()}"), "a.jsonl line 7: field 'text' is dict")),
]


class DataProbe(Probe):
    def records_text(self, count: int) -> bytes:
        return b"".join(json.dumps({"text": f"document number {i}"}).encode() + b"\n" for i in range(count))

    def folder(self, name: str, *files: str) -> str:
        for file in files:
            self.write(f"{name}/{file}", "")
        (self.root / name).mkdir(exist_ok=True)
        return str(self.root / name)

    def mixed_folder(self) -> str:
        self.records("mixed/a.jsonl")
        self.parquet("mixed/b.parquet", {"text": ["x y z"] * 10})
        return str(self.root / "mixed")

    def glob_with_txt(self) -> str:
        self.records("g/a.jsonl")
        self.write("g/notes.txt", "hello")
        return str(self.root / "g" / "*")

    def folder_with_empty_jsonl(self) -> str:
        self.records("f/a.jsonl")
        self.write("f/b.jsonl", "")
        return str(self.root / "f")

    def folder_with_bad_jsonl(self) -> str:
        self.write("docs/a.txt", "plain text " * 200)
        self.records("docs/b.jsonl", bad={4: b"{oops"})
        return str(self.root / "docs")

    def tokens_beside(self, name: str, raw: bytes) -> str:
        """A good token file a.bin with the file `name` (a sidecar) beside it holding `raw`."""
        path = self.tokens("a.bin", [5] * ENOUGH)
        self.write(name, raw)
        return path

    def broken_tokenizer(self) -> str:
        folder = self.tokenizer()
        with open(f"{folder}/tokenizer.json", "w") as f:
            f.write("{broken")
        return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return tokenizer_folder(tmp_path_factory)


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_data_is_one_line_before_anything_is_written(case, tmp_path, capsys, monkeypatch, tokenizer_dir):
    t = DataProbe(tmp_path, capsys, monkeypatch, tokenizer_dir)
    extra, expected = case[1](t)
    t.refused("train", t.train(*extra), expected)
