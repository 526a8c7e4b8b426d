"""scripts/prepare_data.py end to end with a tokenizer built here (no hub): the token file equals
the `tokenizers` library's own encoding of each document plus EOS, loads through
`data.source="tokens"`, and its sidecar lets a run refuse a too-small vocabulary or a wrong dtype."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from ml_collections import ConfigDict
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxpar.data import load_tokens
from jaxpar.data import prepare as prepare_module
from jaxpar.data.prepare import PrepareError, choose_dtype, prepare, token_file_problems
from tests.support.paths import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "prepare_data.py")
LINES = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny tokenizer for a tiny test",
    "checkpoints resume exactly on any mesh",
    "def train(config): return loss",
]


def build_tokenizer(directory) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(LINES * 5, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>").save_pretrained(
        str(directory)
    )
    return tokenizer


def run_script(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, SCRIPT, "--noprogress", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.timeout(180)
def test_prepare_data_end_to_end(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text(LINES[0] + "\n" + LINES[1] + "\n")
    (corpus / "sub" / "b.txt").write_text(LINES[2])
    (corpus / ".hidden").write_text("never read")
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": LINES[3]}) + "\n\n" + json.dumps({"text": LINES[0]}) + "\n")
    output = tmp_path / "tokens.bin"

    done = run_script(f"--tokenizer={tmp_path / 'tok'}", f"--input={corpus},{docs}", f"--output={output}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--config.data.token_dtype=uint16" in done.stdout

    eos = tokenizer.token_to_id("</s>")
    documents = [LINES[0] + "\n" + LINES[1] + "\n", LINES[2], LINES[3], LINES[0]]  # sorted files, then the jsonl
    expected = np.concatenate([tokenizer.encode(d, add_special_tokens=False).ids + [eos] for d in documents])
    written = np.fromfile(output, dtype=np.uint16)
    np.testing.assert_array_equal(written, expected)
    meta = json.loads((tmp_path / "tokens.bin.json").read_text())
    vocab = tokenizer.get_vocab_size()
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == vocab and expected.max() < vocab
    assert meta["num_tokens"] == len(expected) and meta["num_documents"] == 4 and meta["eos_token_id"] == eos

    data = ConfigDict(dict(source="tokens", path=str(output), token_dtype="uint16", max_corpus_bytes=0))
    np.testing.assert_array_equal(load_tokens(data), expected)
    assert token_file_problems(str(output), "uint16", vocab) == []
    problems = token_file_problems(str(output), "uint32", vocab - 1)
    assert len(problems) == 2
    assert problems[0].startswith("data.token_dtype='uint32' but") and "set data.token_dtype='uint16'" in problems[0]
    assert problems[1].startswith(f"model.vocab_size={vocab - 1} is smaller than the {vocab} tokens")
    with open(output, "r+b") as f:
        f.truncate(os.path.getsize(output) - 2)
    (problem,) = token_file_problems(str(output), "uint16", vocab)
    assert f"says {len(expected)} uint16 tokens; regenerate it" in problem


@pytest.mark.slow
def test_prepare_data_rejects_bad_input_in_one_line(tmp_path):
    build_tokenizer(tmp_path / "tok")
    (tmp_path / "a.txt").write_text(LINES[0])
    cases = {
        (f"--tokenizer={tmp_path / 'nope'}", f"--input={tmp_path / 'a.txt'}"): "--tokenizer=",
        (f"--tokenizer={tmp_path / 'tok'}", f"--input={tmp_path / 'missing.txt'}"): "--input=",
    }
    for args, flag in cases.items():
        done = run_script(*args, f"--output={tmp_path / 'out.bin'}")
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and last.startswith(f"error: {flag}") and (
            "does not exist" in last or "is not a directory" in last
        ), last
    assert not os.path.exists(tmp_path / "out.bin")


def test_dtype_follows_the_vocabulary():
    assert choose_dtype(120) == "uint16" and choose_dtype(65536) == "uint16" and choose_dtype(65537) == "uint32"
    assert choose_dtype(128256, "uint32") == "uint32"
    with pytest.raises(PrepareError, match=r"--dtype=uint16 holds ids up to 65535 but the tokenizer has 128256 tokens"):
        choose_dtype(128256, "uint16")


def test_chunked_reading_matches_whole_documents(tmp_path, monkeypatch):
    # Chunks far smaller than the lines (and one line longer than a chunk): with a tokenizer that does
    # not merge across newlines, chunking must not change a single id.
    tokenizer = build_tokenizer(tmp_path / "tok")
    text = "\n".join(LINES * 3) + "\n" + " ".join(LINES) + "\nno newline at the end"
    (tmp_path / "big.txt").write_text(text)
    monkeypatch.setattr(prepare_module, "CHUNK_BYTES", 50)
    monkeypatch.setattr(prepare_module, "BATCH_PIECES", 3)
    meta = prepare(str(tmp_path / "tok"), [str(tmp_path / "big.txt")], str(tmp_path / "out.bin"), progress=False)
    expected = tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.token_to_id("</s>")]
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out.bin", dtype=np.uint16), expected)
    assert meta["num_documents"] == 1


def test_an_existing_token_file_or_sidecar_is_never_overwritten_silently(tmp_path):
    build_tokenizer(tmp_path / "tok")
    (tmp_path / "a.txt").write_text(LINES[0])
    output = tmp_path / "out.bin"
    args = (str(tmp_path / "tok"), [str(tmp_path / "a.txt")], str(output))
    for existing in (output, tmp_path / "out.bin.json"):
        existing.write_bytes(b"earlier")
        with pytest.raises(PrepareError, match=f"--output={output}: {existing} already exists; pass --overwrite"):
            prepare(*args, progress=False)
        assert existing.read_bytes() == b"earlier" and not os.path.exists(str(output) + ".partial")
        existing.unlink()
    (tmp_path / "out.bin.json").write_text("{}")
    meta = prepare(*args, progress=False, overwrite=True)
    assert json.loads((tmp_path / "out.bin.json").read_text()) == meta


@pytest.mark.slow
def test_undecodable_bytes_are_counted_and_a_binary_file_is_refused(tmp_path):
    build_tokenizer(tmp_path / "tok")
    text = (LINES[0] + "\n") * 40  # 1760 bytes of text with 3 bytes that are not UTF-8
    (tmp_path / "mostly.txt").write_bytes(text[:100].encode() + b"\xff\xfe" + text[100:].encode() + b"\xc3")
    meta = prepare(str(tmp_path / "tok"), [str(tmp_path / "mostly.txt")], str(tmp_path / "a.bin"), progress=False)
    assert meta["undecodable_bytes"] == 3, meta
    (tmp_path / "binary.dat").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(PrepareError, match=r"binary.dat: 1024 of 2048 bytes \(50.0%\) are not UTF-8"):
        prepare(str(tmp_path / "tok"), [str(tmp_path / "binary.dat")], str(tmp_path / "b.bin"), progress=False)
    assert not os.path.exists(tmp_path / "b.bin") and not os.path.exists(tmp_path / "b.bin.partial")
    # The script: --overwrite replaces the file written above, and the replaced bytes are reported.
    done = run_script(f"--tokenizer={tmp_path / 'tok'}", f"--input={tmp_path / 'mostly.txt'}", f"--output={tmp_path / 'a.bin'}",
                      "--overwrite")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"warning: 3 bytes of 1763 were not UTF-8 and became U+FFFD (most in {tmp_path / 'mostly.txt'})" in done.stderr
