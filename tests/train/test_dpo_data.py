"""Preference pairs as data (`data.format="preference"`) and DPO's bad input.

Packing: each pair is read from a .jsonl file through the production pipeline and checked against
the bytes of its record (the byte tokenizer: a token is a byte): prompt + chosen is one segment,
prompt + rejected the next one in the same row, the mask 1 on the chosen completion's bytes and 2 on
the rejected one's. A pair longer than a row is cut by the documented policy, one whose prompt fills a
row is skipped. Bad input through scripts/train.py's `main`: one line, exit 2, nothing written
(`tests/train/probe.py`)."""

import json

import numpy as np
import pytest

from jaxpar.data.chat import Rendered
from jaxpar.data.corpus import training_stream
from jaxpar.data.formats import fit_pair
from jaxpar.data.packing import Packer
from tests.support import tiny
from tests.support.chat import write_records
from tests.train.probe import Probe

PAIRS = [{"prompt": "Say hi", "chosen": "hi!", "rejected": "no"}, {"prompt": "2+2=", "chosen": "4", "rejected": "five"},
         {"prompt": "Name a colour:", "chosen": " blue", "rejected": " a car"}]


def test_pairs_pack_as_two_segments_of_one_row(tmp_path):
    config = tiny.llama({"global_batch_size": 2, "seq_len": 31, "objective": "dpo"}, vocab_size=256)
    config.data.update(source="text", path=write_records(tmp_path / "p.jsonl", PAIRS * 3), format="preference")
    batch = next(Packer(training_stream(config), 2, 32))
    assert batch.shape == (2, 3, 32)
    expected = {(r["prompt"] + r["chosen"], r["prompt"] + r["rejected"]): r for r in PAIRS}
    found = 0
    for ids, segments, mask in batch:
        for s in range(1, segments.max() + 1, 2):  # chosen at odd segments, its rejected half next
            chosen, rejected = segments == s, segments == s + 1
            text = tuple(bytes(ids[part].astype(np.uint8)).decode() for part in (chosen, rejected))
            record = expected[text]
            assert list(mask[chosen]) == [0] * len(record["prompt"]) + [1] * len(record["chosen"])
            assert list(mask[rejected]) == [0] * len(record["prompt"]) + [2] * len(record["rejected"])
            found += 1
    assert found >= 4


def _half(prompt: int, completion: int) -> Rendered:
    n = prompt + completion
    return Rendered(np.arange(n, dtype=np.int32), np.r_[np.zeros(prompt), np.ones(completion)].astype(np.int32), (n,))


@pytest.mark.parametrize("lengths, width, kept, outcome", [
    (((3, 4), (3, 5)), 20, (7, 8), None),  # fits: untouched
    (((3, 2), (3, 20)), 20, (5, 15), "pair_cut"),  # the short half fits in half a row: only the long one is cut
    (((3, 12), (3, 20)), 20, (10, 10), "pair_cut"),  # both long: half a row each
    (((10, 2), (10, 3)), 20, None, "pair_skipped"),  # the prompt leaves the second half no completion token
])
def test_long_pairs_are_cut_or_skipped(lengths, width, kept, outcome):
    fitted, got = fit_pair(tuple(_half(*h) for h in lengths), width)
    assert got == outcome
    assert (None if fitted is None else tuple(len(h.ids) for h in fitted)) == kept


BAD = {
    "no_rejected": (["--config.train.objective=dpo"], {"prompt": "a", "chosen": "b"}, "p.jsonl line 2 has no 'rejected' field"),
    "beta": (["--config.train.objective=dpo", "--config.train.dpo.beta=0.0"], None, "train.dpo.beta=0.0 must be > 0"),
    "smoothing": (["--config.train.objective=dpo", "--config.train.dpo.label_smoothing=0.5"], None,
                  "train.dpo.label_smoothing=0.5 must be in [0.0, 0.5)"),
    "objective": (["--config.train.objective=ppo"], None, "train.objective='ppo' is not one of"),
    "lm_on_pairs": ([], None, "data.format='preference' holds preference pairs"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_dpo_input(name, tmp_path, capsys, monkeypatch):
    t = Probe(tmp_path, capsys, monkeypatch)
    flags, bad, expected = BAD[name]
    lines = [json.dumps(r) for r in PAIRS * 4]
    if bad is not None:
        lines[1] = json.dumps(bad)
    path = t.write("p.jsonl", "\n".join(lines) + "\n")
    data = ["--config.data.source=text", f"--config.data.path={path}", "--config.data.format=preference"]
    t.refused("train", t.train(*data, *flags), expected)


def test_dpo_needs_preference_data(tmp_path, capsys, monkeypatch):
    t = Probe(tmp_path, capsys, monkeypatch)
    t.refused("train", t.train("--config.train.objective=dpo"), "train.objective='dpo' trains preference pairs, but data.format is text")


def test_message_pairs_render_as_the_chat_template_does(tmp_path):
    """Pairs of messages: each half is what transformers' `apply_chat_template` renders for the prompt
    plus that completion, its mask starting where the prompt with the generation prompt ends."""
    transformers = pytest.importorskip("transformers")
    from tests.support.chat import make_chat_tokenizer

    folder = make_chat_tokenizer(tmp_path / "chatml")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = [{"role": "user", "content": "hello be brief"}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "hi"}],
              "rejected": [{"role": "assistant", "content": "goodbye goodbye"}]}
    config = tiny.llama({"global_batch_size": 1, "seq_len": 63, "objective": "dpo"}, vocab_size=384)
    config.data.update(source="text", path=write_records(tmp_path / "p.jsonl", [record]), format="preference", tokenizer=folder)
    ids, segments, mask = next(Packer(training_stream(config), 1, 64))[0]
    start = len(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
    for s, half, mark in ((1, "chosen", 1), (2, "rejected", 2)):
        whole = tokenizer.apply_chat_template(prompt + record[half], tokenize=True, return_dict=True)["input_ids"]
        assert list(ids[segments == s]) == list(whole)
        assert list(mask[segments == s]) == [0] * start + [mark] * (len(whole) - start)
