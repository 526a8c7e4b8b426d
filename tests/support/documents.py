"""Small corpora and a local tokenizer for the document tests, made on the spot (no downloads).

`make_tokenizer` trains a tiny BPE with the `tokenizers` library and saves it as a transformers
tokenizer folder whose template puts <s> in front of a text (so a document is <s> ... </s>).
`packed_batch` packs documents (lists of ids) into one global batch with the production packer.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxpar.data.packing import ListStream

WORDS = ("the quick brown fox jumps over a lazy dog while packed documents never see each other "
         "and every target stays inside its own document as the mask says").split()


def texts(count: int, seed: int = 0, low: int = 2, high: int = 30, prefix: str = "") -> list[str]:
    """`count` random texts of `low` .. `high` words (a `prefix` word first, to tell sources apart)."""
    rng = np.random.default_rng(seed)
    return [" ".join(([prefix] if prefix else []) + list(rng.choice(WORDS, rng.integers(low, high + 1))))
            for _ in range(count)]


def make_tokenizer(directory, vocab_size: int = 120, bos: bool = True) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(texts(200, seed=1), trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
        )
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        str(directory)
    )
    return str(directory)


def write_jsonl(path, lines: list[str], field: str = "text") -> str:
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps({field: line, "id": len(line)}) + "\n")
    return str(path)


def packed_batch(docs, rows: int, width: int, packing: bool = True) -> np.ndarray:
    from jaxpar.data.packing import Packer

    return next(Packer(ListStream(docs), rows, width, packing))


def documents_in(batch: np.ndarray) -> list[np.ndarray]:
    """The documents of a packed batch [G, 2, W], row by row, segment by segment."""
    found = []
    for row in batch:
        for seg in np.unique(row[1][row[1] > 0]):
            found.append(row[0][row[1] == seg])
    return found
