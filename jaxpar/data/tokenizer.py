"""Tokenizers: the byte-level one (every UTF-8 byte is one token, so any text encodes with no
vocabulary file) and, for documents, a local transformers tokenizer (`data.tokenizer`) with the
special tokens that mark where a document starts and ends."""

from __future__ import annotations

import logging
import os

import numpy as np

from jaxpar.extras import MissingExtra, require
from jaxpar.model_facts import VOCAB_PAD_MULTIPLE, padded_vocab_size


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
    prefix, suffix = (), ()  # no special tokens around a document

    def encode_document(self, text: str | bytes) -> np.ndarray:
        return ByteTokenizer().encode(text)

    def encode_text(self, text: str) -> list[int]:
        return ByteTokenizer().encode(text).tolist()


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message is one line naming `data.tokenizer`."""


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' import-time advice that PyTorch was not found: PyTorch serves its models,
    never a tokenizer, and `pip install -e ".[data]"` rightly leaves it out."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in record.getMessage()


def _transformers(needed_by: str):
    """transformers, imported here: it takes seconds and only tokenized sources need it."""
    logger = logging.getLogger("transformers")  # the logger transformers' own advice goes to
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())
    try:
        return require("transformers", needed_by)
    except MissingExtra as e:
        raise TokenizerError(str(e)) from None


def load_tokenizer(path: str, key: str = "data.tokenizer"):
    """The transformers tokenizer saved in the local folder `path` (never the hub); TokenizerError,
    one line naming `key`, if there is none or transformers is missing."""
    named = f"{key}={path}" if key.startswith("--") else f"{key}={path!r}"  # a flag as typed, a config key as repr
    if not os.path.isdir(path):
        raise TokenizerError(f"{named} is not a directory; point it at a saved tokenizer (tokenizer.json etc.)")
    transformers = _transformers(named)
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise TokenizerError(f"{named} holds no loadable tokenizer ({type(e).__name__}: {first})") from None


class TextTokenizer:
    """A local transformers tokenizer as a document encoder. A document is wrapped the way the
    tokenizer wraps a text itself (`add_special_tokens`: e.g. Llama's BOS in front), and ends with
    the tokenizer's EOS when it has one and its template did not already put it there, so the
    packer (and `prepare_data.py`'s token files) see where each document starts and ends."""

    def __init__(self, path: str, key: str = "data.tokenizer"):
        self.tokenizer = load_tokenizer(path, key)
        self.name = os.path.abspath(path)
        self.vocab_size = len(self.tokenizer)  # includes added special tokens
        self.prefix, self.suffix = special_tokens(self.tokenizer)

    def encode_document(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self.prefix + self.encode_text(text) + self.suffix, dtype=np.int32)

    def encode_text(self, text: str) -> list[int]:
        """The ids of a text alone, without the special tokens around a document."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


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


def vocab_size_fix(needed: int) -> str:
    """The override that gives the model room for `needed` token ids, rounded up to the multiple the
    embedding is padded to anyway (the larger vocabulary costs nothing more)."""
    size = padded_vocab_size(needed)
    rounded = f" ({needed} rounded up to a multiple of {VOCAB_PAD_MULTIPLE}, as the embedding is padded anyway)" if size != needed else ""
    return f"train with --config.model.vocab_size={size}{rounded}"
