"""Corpus sources: `config.data` → one flat 1-D token array.

- "stdlib": the Python standard library's own `.py` files — a corpus that needs no download. Files are
  taken in sorted relative-path order (skipping site-packages, test dirs, caches) and joined with
  SEPARATOR until `data.max_corpus_bytes`, so the corpus is identical on every run of one interpreter.
- "text": `data.path` is a text file or a folder. A folder contributes every regular, non-hidden file
  below it (recursive, sorted by relative path), joined with SEPARATOR: the byte tokenizer accepts any
  bytes, so no extension filter is needed; hidden files/dirs (`.git`, `.DS_Store`) are skipped.
  Not capped by `max_corpus_bytes` (that cap is for the built-in corpus only).
- "tokens": `data.path` is a flat binary file of `data.token_dtype` integers, memory-mapped read-only so
  corpora larger than RAM work.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

from jaxpar.data.tokenizer import ByteTokenizer

SOURCES = ("stdlib", "text", "tokens")
BYTE_SOURCES = ("stdlib", "text")
TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
SEPARATOR = b"\n\n"

# Stdlib dirs whose content varies by build/install (site-packages) or is test code.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _sorted_files(root: str, skip_dir, keep_file) -> list[str]:
    """Relative paths of files under `root` in sorted order (sorted globally, not per-directory)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if keep_file(name) and os.path.isfile(full) and not os.path.islink(full):
                found.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(found)


def _join(root: str, rel_paths: list[str], limit: int | None) -> bytes:
    parts, total = [], 0
    for rel in rel_paths:
        if limit is not None and total >= limit:
            break
        with open(os.path.join(root, rel), "rb") as f:
            chunk = f.read() if limit is None else f.read(limit - total)
        if parts:
            chunk = SEPARATOR + chunk
        parts.append(chunk)
        total += len(chunk)
    data = b"".join(parts)
    return data if limit is None else data[:limit]


def stdlib_corpus_bytes(max_bytes: int) -> bytes:
    root = sysconfig.get_paths()["stdlib"]
    files = _sorted_files(
        root,
        skip_dir=lambda d: d in _STDLIB_SKIP_DIRS or d.startswith("."),
        keep_file=lambda n: n.endswith(".py"),
    )
    return _join(root, files, max_bytes)


def text_corpus_bytes(path: str) -> bytes:
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    files = _sorted_files(path, skip_dir=lambda d: d.startswith("."), keep_file=lambda n: not n.startswith("."))
    return _join(path, files, None)


def source_problems(data_config) -> list[str]:
    """One-line problems with `config.data` alone; stats paths, reads no corpus."""
    data, errors = data_config, []
    source = data.source
    if source not in SOURCES:
        errors.append(f"data.source={source!r} is not one of {SOURCES}; set data.source")
    dtype_name = str(data.token_dtype)
    if dtype_name not in TOKEN_DTYPES:
        errors.append(f"data.token_dtype={dtype_name!r} is not one of {TOKEN_DTYPES}; set data.token_dtype")
    if source == "stdlib" and int(data.max_corpus_bytes) <= 0:
        errors.append(f"data.max_corpus_bytes={data.max_corpus_bytes} must be positive; set data.max_corpus_bytes")
    if source not in ("text", "tokens"):
        return errors
    path = str(data.path or "")
    kind = "a text file or folder" if source == "text" else "a flat binary token file"
    if not path:
        errors.append(f"data.path is empty but data.source={source!r} needs it; set data.path to {kind}")
    elif not os.path.exists(path):
        errors.append(f"data.path={path!r} does not exist; set data.path to {kind}")
    elif source == "tokens" and not os.path.isfile(path):
        errors.append(f"data.path={path!r} is not a file; set data.path to {kind}")
    elif source == "tokens" and dtype_name in TOKEN_DTYPES:
        size, itemsize = os.path.getsize(path), np.dtype(dtype_name).itemsize
        if size == 0:
            errors.append(f"data.path={path!r} is empty; set data.path to a non-empty token file")
        elif size % itemsize:
            errors.append(
                f"data.path={path!r} is {size} bytes, not a multiple of {dtype_name}'s {itemsize}; check data.token_dtype"
            )
    return errors


def load_tokens(data_config) -> np.ndarray:
    """The whole corpus as a 1-D integer array (a read-only np.memmap for "tokens")."""
    problems = source_problems(data_config)
    if problems:
        raise ValueError(problems[0])
    source = data_config.source
    if source == "stdlib":
        data = stdlib_corpus_bytes(int(data_config.max_corpus_bytes))
        if not data:
            raise ValueError("the stdlib corpus is empty (no .py files found); set data.source='text' and data.path")
        return ByteTokenizer().encode(data)
    if source == "text":
        data = text_corpus_bytes(data_config.path)
        if not data:
            raise ValueError(f"data.path={data_config.path!r} holds no text; set data.path to a non-empty text file or folder")
        return ByteTokenizer().encode(data)
    return np.memmap(data_config.path, dtype=np.dtype(str(data_config.token_dtype)), mode="r")


def validate_data_config(config) -> list[str]:
    """One-line problems with `config.data` and its fit with `config.model`; reads no corpus."""
    errors = source_problems(config.data)
    vocab = int(config.model.vocab_size)
    if config.data.source in BYTE_SOURCES and vocab < ByteTokenizer.vocab_size:
        errors.append(
            f"model.vocab_size={vocab} is below the byte tokenizer's {ByteTokenizer.vocab_size} "
            f"(data.source={config.data.source!r}); set model.vocab_size >= 256"
        )
    return errors
