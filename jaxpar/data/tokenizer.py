"""Tokenizers: the byte-level one (every UTF-8 byte is one token, so any text encodes with no
vocabulary file) and, for documents, a local transformers tokenizer (`data.tokenizer`) with the
special tokens that mark where a document starts and ends."""

from __future__ import annotations

import os

import numpy as np


class ByteTokenizer:
    """Token id = byte value (0..255)."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        # frombuffer is zero-copy uint8; widen to the int32 the model consumes.
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError(f"ByteTokenizer.decode: ids must be in [0, 255], got range [{ids.min()}, {ids.max()}]")
        # A window may cut a multi-byte character in half; replace rather than fail.
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class ByteDocuments:
    """The byte tokenizer as a document encoder: a document is its UTF-8 bytes (no special tokens)."""

    vocab_size = ByteTokenizer.vocab_size
    name = "bytes"

    def encode_document(self, text: str | bytes) -> np.ndarray:
        return ByteTokenizer().encode(text)


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message is one line naming `data.tokenizer`."""


class TextTokenizer:
    """A local transformers tokenizer as a document encoder. A document is wrapped the way the
    tokenizer wraps a text itself (`add_special_tokens`: e.g. Llama's BOS in front), and ends with
    the tokenizer's EOS when it has one and its template did not already put it there, so the
    packer (and `prepare_data.py`'s token files) see where each document starts and ends."""

    def __init__(self, path: str, key: str = "data.tokenizer"):
        if not os.path.isdir(path):
            raise TokenizerError(f"{key}={path!r} is not a directory; point it at a saved tokenizer (tokenizer.json etc.)")
        # Imported here: transformers takes seconds to import and only tokenized sources need it.
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise TokenizerError(f"{key}={path!r} holds no loadable tokenizer ({type(e).__name__}: {first})") from None
        self.name = os.path.abspath(path)
        self.vocab_size = len(self.tokenizer)  # includes added special tokens
        self.prefix, self.suffix = special_tokens(self.tokenizer)

    def encode_document(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return np.asarray(self.prefix + ids + self.suffix, dtype=np.int32)


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) a document's text: what the tokenizer's template adds around a text
    (found by encoding one with and without it), and its EOS last if it has one."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    wrapped = tokenizer(probe, add_special_tokens=True)["input_ids"]
    prefix, suffix = [], []
    for start in range(len(wrapped) - len(plain) + 1):
        if wrapped[start : start + len(plain)] == plain:
            prefix, suffix = wrapped[:start], wrapped[start + len(plain) :]
            break
    eos = tokenizer.eos_token_id
    if eos is not None and (not suffix or suffix[-1] != eos):
        suffix = suffix + [eos]
    return list(prefix), list(suffix)


def document_encoder(path: str, key: str = "data.tokenizer"):
    """`ByteDocuments` for "", else the `TextTokenizer` in folder `path`."""
    return ByteDocuments() if not path else TextTokenizer(path, key)
