"""Corpus sources: what each `data.source` reads, its checks, and (for the token-stream views) one
flat 1-D token array. Documents — how every source is cut into them, packed and mixed — are
`jaxpar.data.corpus`'s; this module checks one source's settings and files.

- "stdlib": the Python standard library's own `.py` files — a corpus that needs no download. Files are
  taken in sorted relative-path order (skipping site-packages, test dirs, caches) and joined with
  SEPARATOR until `data.max_corpus_bytes`, so the corpus is identical on every run of one interpreter.
- "text": `data.path` is a text file or a folder. A folder contributes every regular, non-hidden file
  below it (recursive, sorted by relative path), joined with SEPARATOR: the byte tokenizer accepts any
  bytes, so no extension filter is needed; hidden files/dirs (`.git`, `.DS_Store`) are skipped.
  Not capped by `max_corpus_bytes` (that cap is for the built-in corpus only).
- "tokens": `data.path` is a flat binary file of `data.token_dtype` integers, memory-mapped read-only so
  corpora larger than RAM work.
- "datasets": `data.path` is a file, folder or glob of jsonl / json / parquet / arrow files, streamed
  by Hugging Face `datasets` (`jaxpar.data.hf_stream`); documents only, no flat view.

`token_range_problems` checks that a token file's ids lie in [0, vocab_size) — every id of a small
file, evenly spaced blocks of a large one (`RANGE_SAMPLE_BLOCKS`).
`corpus_warnings` names what is accepted but suspicious: a token file without the sidecar its dtype
could be checked against (and ids that look like another dtype's), a text source that is mostly
binary. `corpus_fingerprint` hashes one source's size and evenly spaced blocks of its bytes (all of
a small one), cheaply, so a checkpoint can tell a corpus rewritten under it even at the same size.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import os
import sysconfig

import numpy as np

from jaxpar.data.prepare import sidecar_path
from jaxpar.data.tokenizer import ByteTokenizer, vocab_size_fix

SOURCES = ("stdlib", "text", "tokens", "datasets")
TEXT_SOURCES = ("stdlib", "text", "datasets")  # tokenized by data.tokenizer (bytes when unset)
PATH_SOURCES = ("text", "tokens", "datasets")
TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
SEPARATOR = b"\n\n"

# Stdlib dirs whose content varies by build/install (site-packages) or is test code.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
# Token files up to this many tokens are range-checked in full (64M uint16 ids: ~0.1 s); larger ones
# by RANGE_SAMPLE_BLOCKS evenly spaced blocks of RANGE_BLOCK_TOKENS ids, first and last included.
RANGE_FULL_TOKENS = 1 << 26
RANGE_SAMPLE_BLOCKS = 64
RANGE_BLOCK_TOKENS = 1 << 16
# corpus_fingerprint: corpora up to FINGERPRINT_FULL_BYTES are hashed whole (~2 ms per MiB), larger
# ones by FINGERPRINT_BLOCKS evenly spaced blocks of FINGERPRINT_BLOCK_BYTES, first and last included.
FINGERPRINT_FULL_BYTES = 8 << 20
FINGERPRINT_BLOCKS = 256
FINGERPRINT_BLOCK_BYTES = 4096
# corpus_warnings: a text source with more than this fraction of sampled bytes that are control
# bytes or not UTF-8 looks binary (text has ~0; random bytes ~0.6).
BINARY_FRACTION = 0.1


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


def _stdlib_files() -> tuple[str, list[str]]:
    root = sysconfig.get_paths()["stdlib"]
    files = _sorted_files(
        root,
        skip_dir=lambda d: d in _STDLIB_SKIP_DIRS or d.startswith("."),
        keep_file=lambda n: n.endswith(".py"),
    )
    return root, files


def _text_files(path: str) -> list[str]:
    return _sorted_files(path, skip_dir=lambda d: d.startswith("."), keep_file=lambda n: not n.startswith("."))


def stdlib_corpus_bytes(max_bytes: int) -> bytes:
    return _join(*_stdlib_files(), max_bytes)


def text_corpus_bytes(path: str) -> bytes:
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    return _join(path, _text_files(path), None)


def text_files(path: str) -> list[str]:
    """The files a "text" source reads: `path` itself, or every non-hidden file below the folder."""
    return [path] if os.path.isfile(path) else [os.path.join(path, rel) for rel in _text_files(path)]


def stdlib_files() -> tuple[str, list[str]]:
    """(root, sorted relative paths) of the stdlib corpus's files."""
    return _stdlib_files()


def source_tokens(data_config) -> int:
    """A source's size from file sizes alone, in tokens where that is known without tokenizing
    (byte-tokenized text: one per byte; token files), else in bytes. Kept in checkpoints: a
    changed corpus is refused on resume."""
    source, path = data_config.source, str(data_config.path)
    if source == "stdlib":
        root, rel_paths = _stdlib_files()
        return min(sum(os.path.getsize(os.path.join(root, rel)) for rel in rel_paths), int(data_config.max_corpus_bytes))
    if source == "text":
        return sum(os.path.getsize(f) for f in text_files(path))
    if source == "datasets":
        from jaxpar.data.hf_stream import dataset_files

        return sum(os.path.getsize(f) for f in dataset_files(path))
    return os.path.getsize(path) // np.dtype(str(data_config.token_dtype)).itemsize


def _segments(data_config) -> list[tuple[str, int]]:
    """(file, bytes of it in the corpus), in corpus order (SEPARATORs left out)."""
    source, path = data_config.source, str(data_config.path)
    if source == "stdlib":
        root, files = _stdlib_files()
        room, segments = int(data_config.max_corpus_bytes), []
        for rel in files:
            if room <= 0:
                break
            size = min(os.path.getsize(os.path.join(root, rel)), room)
            segments.append((os.path.join(root, rel), size))
            room -= size + len(SEPARATOR)
        return segments
    if source == "datasets":
        from jaxpar.data.hf_stream import dataset_files

        return [(f, os.path.getsize(f)) for f in dataset_files(path)]
    if source == "text" and os.path.isdir(path):
        return [(os.path.join(path, rel), os.path.getsize(os.path.join(path, rel))) for rel in _text_files(path)]
    return [(path, os.path.getsize(path))]


def _read_span(segments, starts, offset: int, length: int) -> bytes:
    """`length` bytes at `offset` of the segments' concatenation."""
    parts, index = [], bisect.bisect_right(starts, offset) - 1
    while length > 0 and index < len(segments):
        path, size = segments[index]
        within = offset - starts[index]
        take = min(length, size - within)
        with open(path, "rb") as f:
            f.seek(within)
            parts.append(f.read(take))
        offset, length, index = offset + take, length - take, index + 1
    return b"".join(parts)


def corpus_fingerprint(data_config) -> str:
    """A hash of the corpus's size and content (all of it if small, else evenly spaced blocks)."""
    segments = _segments(data_config)
    starts = list(np.cumsum([0] + [size for _, size in segments[:-1]]))
    total = sum(size for _, size in segments)
    digest = hashlib.blake2b(str(total).encode(), digest_size=16)
    if total <= FINGERPRINT_FULL_BYTES:
        spans = [(start, size) for start, (_, size) in zip(starts, segments)]
    else:
        offsets = np.linspace(0, total - FINGERPRINT_BLOCK_BYTES, FINGERPRINT_BLOCKS).astype(np.int64)
        spans = [(int(o), FINGERPRINT_BLOCK_BYTES) for o in offsets]
    for offset, length in spans:
        digest.update(_read_span(segments, starts, offset, length))
    return digest.hexdigest()


def _sample(array: np.ndarray, blocks: int = 16, size: int = 4096) -> np.ndarray:
    if len(array) <= blocks * size:
        return np.asarray(array)
    starts = np.linspace(0, len(array) - size, blocks).astype(np.int64)
    return np.concatenate([np.asarray(array[s : s + size]) for s in starts])


def _binary_fraction(data: bytes) -> float:
    """Fraction of `data` that is control bytes (other than tab, newline, CR) or not UTF-8."""
    if not data:
        return 0.0
    raw = np.frombuffer(data, np.uint8)
    control = int(np.count_nonzero(((raw < 32) & ~np.isin(raw, (9, 10, 13))) | (raw == 127)))
    invalid = data.decode("utf-8", errors="replace").count("\ufffd")
    return (control + invalid) / len(data)


def corpus_warnings(data_config, tokens: np.ndarray) -> list[str]:
    """One line each for what the corpus preflight accepts but looks wrong (module docstring)."""
    source, path = data_config.source, str(data_config.path)
    warnings = []
    if source == "tokens" and not os.path.isfile(sidecar_path(path)):
        dtype = str(data_config.token_dtype)
        warning = (
            f"data.path={path!r} has no sidecar {sidecar_path(path)} (scripts/prepare_data.py writes one): "
            f"nothing confirms that it holds data.token_dtype={dtype!r} ids"
        )
        sample = _sample(tokens)
        if np.dtype(dtype).itemsize < 4 and len(sample) >= 2 and np.all(sample[1::2] == 0) and np.any(sample[::2]):
            warning += f"; every second id is 0, as when a file of {np.dtype(dtype).itemsize * 2}-byte ids is read as {dtype}"
        warnings.append(warning)
    if source == "text":
        fraction = _binary_fraction(_sample(tokens).astype(np.uint8).tobytes())
        if fraction > BINARY_FRACTION:
            warnings.append(
                f"data.path={path!r} looks binary: {100 * fraction:.0f}% of sampled bytes are control bytes or not UTF-8 "
                f"(data.source='text' trains on its raw bytes)"
            )
    return warnings


def _blocks(count: int):
    """[start, stop) spans of a token file to range-check: all of it, or evenly spaced blocks."""
    if count <= RANGE_FULL_TOKENS:
        return [(start, min(start + RANGE_FULL_TOKENS // 16, count)) for start in range(0, count, RANGE_FULL_TOKENS // 16)]
    starts = np.linspace(0, count - RANGE_BLOCK_TOKENS, RANGE_SAMPLE_BLOCKS).astype(np.int64)
    return [(int(s), int(s) + RANGE_BLOCK_TOKENS) for s in starts]


def token_range_problems(path: str, token_dtype: str, vocab_size: int, key: str = "data.path",
                         sidecar_vocab: int | None = None) -> list[str]:
    """One line if a token file holds an id outside [0, vocab_size) (in full if small, else sampled),
    or at or above the `sidecar_vocab` its sidecar records (then the sidecar describes another file)."""
    tokens = np.memmap(path, dtype=np.dtype(token_dtype), mode="r")
    count = len(tokens)
    spans = _blocks(count)
    scope = f"all {count} ids" if count <= RANGE_FULL_TOKENS else f"{len(spans)} sampled blocks of {count} ids"
    limit = vocab_size if sidecar_vocab is None else min(vocab_size, sidecar_vocab)
    for start, stop in spans:
        block = np.asarray(tokens[start:stop])
        low, high = int(block.min()), int(block.max())
        if high >= limit or low < 0:
            bad = high if high >= limit else low
            where = start + int(np.argmax(block == bad))
            if bad < 0:
                return [f"{key}={path!r} holds negative token id {bad} at position {where} (checked {scope}); "
                        f"check data.token_dtype"]
            if bad < vocab_size:  # within the model's vocabulary, beyond the sidecar's
                return [
                    f"{key}={path!r} holds token id {bad} at position {where}, not below the vocab_size={sidecar_vocab} "
                    f"its sidecar {sidecar_path(path)} records (checked {scope}): the sidecar describes another file; "
                    f"regenerate both with scripts/prepare_data.py"
                ]
            return [
                f"{key}={path!r} holds token id {bad} at position {where}, not below model.vocab_size={vocab_size} "
                f"(checked {scope}); check data.token_dtype, or {vocab_size_fix(bad + 1)}"
            ]
    return []


def source_problems(data_config, key: str = "data.path") -> list[str]:
    """One-line problems with `config.data` alone (or one source of it: a mixture entry's, named
    `key` in the messages); stats paths, reads no corpus."""
    data, errors = data_config, []
    source = data.source
    if source not in SOURCES:
        errors.append(f"data.source={source!r} is not one of {SOURCES}; set data.source")
    dtype_name = str(data.token_dtype)
    if dtype_name not in TOKEN_DTYPES:
        errors.append(f"data.token_dtype={dtype_name!r} is not one of {TOKEN_DTYPES}; set data.token_dtype")
    if source == "stdlib" and int(data.max_corpus_bytes) <= 0:
        errors.append(f"data.max_corpus_bytes={data.max_corpus_bytes} must be positive; set data.max_corpus_bytes")
    if source not in PATH_SOURCES:
        if data.path and source in SOURCES:
            errors.append(
                f"{key}={data.path!r} is set but data.source={source!r} does not read it; "
                f"set data.source='text', 'tokens' or 'datasets', or {key}=''"
            )
        return errors
    path = str(data.path or "")
    kind = {"text": "a text file or folder", "tokens": "a flat binary token file",
            "datasets": "a jsonl / json / parquet / arrow file, folder or glob"}[source]
    if not path:
        errors.append(f"{key} is empty but data.source={source!r} needs it; set {key} to {kind}")
    elif source == "datasets" and not os.path.exists(path):
        if not glob.glob(path, recursive=True):
            errors.append(f"{key}={path!r} matches no file; set {key} to {kind}")
    elif not os.path.exists(path):
        errors.append(f"{key}={path!r} does not exist; set {key} to {kind}")
    elif not os.access(path, os.R_OK):
        errors.append(f"{key}={path!r} is not readable; check its permissions")
    elif source == "tokens" and not os.path.isfile(path):
        errors.append(f"{key}={path!r} is not a file; set {key} to {kind}")
    elif source == "tokens" and dtype_name in TOKEN_DTYPES:
        size, itemsize = os.path.getsize(path), np.dtype(dtype_name).itemsize
        if size == 0:
            errors.append(f"{key}={path!r} is empty; set {key} to a non-empty token file")
        elif size % itemsize:
            errors.append(
                f"{key}={path!r} is {size} bytes, not a multiple of {dtype_name}'s {itemsize}; check data.token_dtype"
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
