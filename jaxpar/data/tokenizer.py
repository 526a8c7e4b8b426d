"""Byte-level tokenizer: every UTF-8 byte is one token, so any text encodes with no vocabulary file."""

from __future__ import annotations

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
