"""Text → the flat binary `tokens` format that `data.source="tokens"` memory-maps.

The output is one flat array of `uint16` / `uint32` token ids (native byte order, no header): each
document's ids wrapped the way the tokenizer wraps a text (e.g. a BOS in front) and followed by its
EOS id (if it has one; `jaxpar.data.tokenizer.special_tokens`, as the "datasets" source does). A
sidecar `FILE.json` records the dtype, vocabulary size, token count and tokenizer, so a run can
refuse a model whose vocab_size is too small for the file or a `data.token_dtype` that misreads it
(`token_file_problems`); `FILE.offsets.npy` holds where each document starts (int64, documents + 1
entries), which the "tokens" source cuts the file by.

Documents: every text file is one document; in a `.jsonl` file every line is one (its
`text_field`), as every record of a `.json`, `.parquet` or `.arrow` file (read with Hugging Face
`datasets`, `jaxpar.data.hf_stream`). Large text files are read and tokenized in chunks cut after a newline, so a token never
spans a chunk boundary: a tokenizer that merges across a newline (e.g. "\\n\\n" as one token) may
split such a pair into two tokens at a chunk boundary, one place per `CHUNK_BYTES` of text.
The file is written as FILE.partial and renamed when complete, the offsets then the sidecar last. An existing FILE,
sidecar or offsets file is replaced only with `overwrite=True`.

Text is UTF-8: bytes that are not become U+FFFD (one per invalid sequence, as Python's "replace"),
are counted (`undecodable_bytes` in the sidecar, and reported), and a file where more than
`max_undecodable` of the bytes are not UTF-8 — a binary file, another encoding — is refused.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator

import numpy as np
from tqdm.auto import tqdm

from jaxpar.data.documents import DataError, offsets_path
from jaxpar.data.tokenizer import TokenizerError, special_tokens, vocab_size_fix
from jaxpar.data.tokenizer import load_tokenizer as load_text_tokenizer

DTYPES = ("uint16", "uint32")
CHUNK_BYTES = 4 << 20  # text per tokenizer call; bounds memory for multi-GB files
BATCH_PIECES = 64  # chunks/documents per batched (multi-threaded) tokenizer call
SIDECAR_FORMAT = "jaxpar-tokens-v1"
MAX_UNDECODABLE = 0.01  # fraction of a file's bytes that may be replaced before the file is refused


class PrepareError(ValueError):
    """Bad input to prepare_data; the message is one line naming the flag or file."""


def choose_dtype(vocab_size: int, requested: str | None = None) -> str:
    """`requested` if it holds every id below `vocab_size`, else an error; None: the smallest that does."""
    if requested is None:
        return next(name for name in DTYPES if vocab_size - 1 <= np.iinfo(name).max)
    if requested not in DTYPES:
        raise PrepareError(f"--dtype={requested} is not one of {DTYPES}")
    if vocab_size - 1 > np.iinfo(requested).max:
        raise PrepareError(
            f"--dtype={requested} holds ids up to {np.iinfo(requested).max} but the tokenizer has {vocab_size} tokens; "
            f"use --dtype=uint32 or leave --dtype unset"
        )
    return requested


def load_tokenizer(path: str):
    """A transformers tokenizer from a local directory (never the hub)."""
    try:
        return load_text_tokenizer(path, key="--tokenizer")
    except TokenizerError as e:
        raise PrepareError(str(e)) from None


def input_files(inputs: list[str]) -> list[str]:
    """Files named in `inputs`, folders expanded (recursively, sorted, hidden entries skipped)."""
    if not inputs:
        raise PrepareError("--input is empty; give text files or folders")
    files = []
    for entry in inputs:
        if os.path.isfile(entry):
            files.append(entry)
        elif os.path.isdir(entry):
            found = []
            for dirpath, dirnames, filenames in os.walk(entry):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found += [os.path.join(dirpath, n) for n in filenames if not n.startswith(".")]
            files += sorted(found)
        else:
            raise PrepareError(f"--input={entry} does not exist")
    if not files:
        raise PrepareError(f"--input={','.join(inputs)} holds no files")
    return files


RECORD_FORMATS = (".json", ".parquet", ".arrow")  # read with `datasets`, one document per record


class _Undecodable:
    """Counts the bytes replaced by U+FFFD, per file and in all."""

    def __init__(self, max_fraction: float):
        self.max_fraction, self.total, self.in_file, self.worst = max_fraction, 0, 0, ("", 0)

    def decode(self, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            pass
        view, parts, start = memoryview(data), [], 0
        while start < len(data):
            try:
                parts.append(codecs.utf_8_decode(view[start:], "strict", True)[0])
                break
            except UnicodeDecodeError as e:
                parts += [codecs.utf_8_decode(view[start : start + e.start], "strict", True)[0], "\ufffd"]
                self.in_file += e.end - e.start
                start += e.end
        return "".join(parts)

    def check(self, path: str, size: int, *, at_end: bool) -> None:
        """Refuses the file once more than `max_fraction` of its bytes are known not to be UTF-8
        (mid-file, for files of several chunks: a binary file is refused without reading it all)."""
        if self.in_file <= self.max_fraction * size:
            return
        count = f"{'' if at_end else 'at least '}{self.in_file} of {size} bytes"
        raise PrepareError(
            f"--input file {path}: {count} ({100 * self.in_file / size:.1f}%) are not UTF-8 (at most "
            f"{100 * self.max_fraction:g}% may be); is it binary or in another encoding? convert it to UTF-8, "
            f"leave it out, or raise --max_undecodable"
        )

    def end_file(self, path: str, size: int) -> None:
        self.check(path, size, at_end=True)
        self.total += self.in_file
        if self.in_file > self.worst[1]:
            self.worst = (path, self.in_file)
        self.in_file = 0


def _pieces(path: str, undecodable: _Undecodable, text_field: str = "text") -> Iterator[tuple[str, bool, int]]:
    """(text, ends a document, bytes read) for one input file."""
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        text = json.loads(line)[text_field]
                        if not isinstance(text, str):
                            raise TypeError
                    except (ValueError, KeyError, TypeError):
                        raise PrepareError(
                            f"--input file {path} line {number} is not a JSON object with a {text_field!r} text field"
                        ) from None
                    yield text, True, len(line)
                else:
                    yield "", False, len(line)
        return
    if path.endswith(RECORD_FORMATS):
        from jaxpar.data.hf_stream import open_stream

        count = 0
        try:
            for count, record in enumerate(open_stream([path], needed_by=f"--input file {path}", key="--input"), 1):
                text = record.get(text_field)
                if not isinstance(text, str):
                    raise PrepareError(f"--input file {path} record {count} has no {text_field!r} text field")
                yield text, True, 0
        except DataError as e:
            raise PrepareError(str(e)) from None
        except (PrepareError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow / `datasets` failing on the file: one line naming it
            raise PrepareError(f"--input file {path} cannot be read after record {count} ({type(e).__name__}: "
                               f"{(str(e).strip().splitlines() or [''])[0]})") from None
        yield "", False, os.path.getsize(path)  # the progress bar's share of the file
        return
    size = os.path.getsize(path)
    if size == 0:
        return  # no document, not an EOS-only one
    with open(path, "rb") as f:
        pending = b""
        while True:
            block = f.read(CHUNK_BYTES)
            data = pending + block
            if not block:
                text = undecodable.decode(data)
                undecodable.end_file(path, size)
                yield text, True, len(data)
                return
            cut = data.rfind(b"\n") + 1  # keep a trailing partial line (and any split UTF-8 character)
            if cut == 0:
                pending = data
                continue
            pending = data[cut:]
            text = undecodable.decode(data[:cut])
            if size > CHUNK_BYTES:
                undecodable.check(path, size, at_end=False)
            yield text, False, cut


def undecodable_note(meta: dict) -> str | None:
    """The line reporting replaced bytes, if any."""
    count = meta.get("undecodable_bytes", 0)
    if not count:
        return None
    return (
        f"{count} bytes of {meta['input_bytes']} were not UTF-8 and became U+FFFD "
        f"(most in {meta['undecodable_worst_file']})"
    )


def sidecar_path(token_file: str) -> str:
    return token_file + ".json"


def _refuse_input_as_output(output: str, files: list[str]) -> None:
    """The output, its sidecars and the partial file must not be an input: writing one would destroy it."""
    written = (output, sidecar_path(output), offsets_path(output), output + ".partial")
    for path in written:
        for source in files:
            if os.path.abspath(path) == os.path.abspath(source) or (os.path.exists(path) and os.path.samefile(path, source)):
                raise PrepareError(
                    f"--output={output}: writing {path} would replace the --input file {source}; choose another --output"
                )


def _refuse_existing(output: str) -> None:
    for path in (output, sidecar_path(output), offsets_path(output)):
        if os.path.lexists(path):
            raise PrepareError(
                f"--output={output}: {path} already exists; pass --overwrite to replace it or choose another --output"
            )


def prepare(
    tokenizer_path: str,
    inputs: list[str],
    output: str,
    dtype: str | None = None,
    progress: bool = True,
    *,
    text_field: str = "text",
    overwrite: bool = False,
    max_undecodable: float = MAX_UNDECODABLE,
) -> dict:
    """Tokenizes `inputs` into `output`; returns the sidecar dict it also writes to `output`.json
    (and the documents' offsets to `output`.offsets.npy)."""
    files = input_files(inputs)
    _refuse_input_as_output(output, files)
    if not 0 <= max_undecodable <= 1:
        raise PrepareError(f"--max_undecodable={max_undecodable} must be a fraction in [0, 1]")
    if not overwrite:
        _refuse_existing(output)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size = len(tokenizer)  # includes added special tokens
    dtype = choose_dtype(vocab_size, dtype)
    eos = tokenizer.eos_token_id
    prefix, suffix = special_tokens(tokenizer)
    offsets = [0]  # where each document starts, then the end
    starting = True  # the next piece starts a document
    if os.path.dirname(os.path.abspath(output)) and not os.path.isdir(os.path.dirname(os.path.abspath(output))):
        raise PrepareError(f"--output={output}: its folder does not exist")
    partial = output + ".partial"
    undecodable = _Undecodable(max_undecodable)
    num_tokens = num_documents = 0
    largest = -1
    bar = tqdm(
        total=sum(os.path.getsize(f) for f in files), unit="B", unit_scale=True, desc="tokenize", disable=not progress
    )

    def flush(batch, out):
        nonlocal num_tokens, num_documents, largest, starting
        encoded = tokenizer([text for text, _, _ in batch], add_special_tokens=False)["input_ids"]
        for ids, (_, ends, nbytes) in zip(encoded, batch):
            if starting and (ids or ends):
                ids, starting = prefix + ids, False
            if ends:
                ids, starting = ids + suffix, True
            num_documents += ends
            if ids:
                array = np.asarray(ids, dtype=np.int64)
                largest = max(largest, int(array.max()))
                array.astype(dtype).tofile(out)
                num_tokens += len(ids)
            if ends:
                offsets.append(num_tokens)
            bar.update(nbytes)

    try:
        with open(partial, "wb") as out:
            batch = []
            for path in files:
                for piece in _pieces(path, undecodable, text_field):
                    batch.append(piece)
                    if len(batch) >= BATCH_PIECES:
                        flush(batch, out)
                        batch = []
            if batch:
                flush(batch, out)
    except PrepareError:
        os.remove(partial)
        raise
    finally:
        bar.close()
    if num_tokens == 0:
        os.remove(partial)
        raise PrepareError(f"--input={','.join(inputs)} holds no text")
    if largest >= vocab_size:  # a tokenizer whose ids exceed len(tokenizer) would break the vocab check
        os.remove(partial)
        raise PrepareError(f"--tokenizer={tokenizer_path} produced id {largest} >= its {vocab_size} tokens")
    if os.path.lexists(sidecar_path(output)):
        os.remove(sidecar_path(output))  # never an old sidecar beside the new file, even for a moment
    os.replace(partial, output)
    if offsets[-1] != num_tokens:  # a last document without an end (cannot happen: every file ends one)
        offsets.append(num_tokens)
    with open(offsets_path(output) + ".partial", "wb") as f:
        np.save(f, np.asarray(offsets, np.int64))
    os.replace(offsets_path(output) + ".partial", offsets_path(output))
    sidecar = {
        "format": SIDECAR_FORMAT,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "num_tokens": num_tokens,
        "num_documents": num_documents,
        "eos_token_id": eos,
        "tokenizer": os.path.abspath(tokenizer_path),
        "offsets": os.path.basename(offsets_path(output)),
        "num_input_files": len(files),
        "input_bytes": sum(os.path.getsize(f) for f in files),
        "undecodable_bytes": undecodable.total,
    }
    if undecodable.total:
        sidecar["undecodable_worst_file"] = undecodable.worst[0]
    with open(sidecar_path(output), "w") as f:
        json.dump(sidecar, f, indent=2)
    return sidecar


def _sidecar(path: str) -> dict | None:
    side = sidecar_path(path)
    if not os.path.isfile(side):
        return None
    with open(side) as f:
        return json.load(f)


def sidecar_vocab(path: str) -> int | None:
    """The vocabulary size a token file's sidecar records (None: no readable sidecar)."""
    try:
        return int(_sidecar(path)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def token_file_problems(path: str, token_dtype: str, vocab_size: int, key: str = "data.path") -> list[str]:
    """One-line problems of a `tokens` file against `data.token_dtype` and `model.vocab_size`, from its
    sidecar (none if it has no sidecar: then nothing is known about it). `key`: the config key naming
    the file."""
    side = sidecar_path(path)
    try:
        meta = _sidecar(path)
        if meta is None:
            return []
        saved_dtype, saved_vocab, count = str(meta["dtype"]), int(meta["vocab_size"]), int(meta["num_tokens"])
        itemsize = np.dtype(saved_dtype).itemsize
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [
            f"{key}={path!r} has an unreadable sidecar {side} ({type(e).__name__}); "
            f"regenerate it with scripts/prepare_data.py"
        ]
    problems = []
    if saved_dtype != token_dtype:
        problems.append(
            f"data.token_dtype={token_dtype!r} but {side} says {key}={path!r} holds {saved_dtype}; "
            f"set data.token_dtype={saved_dtype!r}"
        )
    if saved_vocab > vocab_size:
        problems.append(
            f"model.vocab_size={vocab_size} is smaller than the {saved_vocab} tokens of the tokenizer that wrote "
            f"{key}={path!r}; {vocab_size_fix(saved_vocab)}"
        )
    if os.path.isfile(path) and os.path.getsize(path) != count * itemsize:
        problems.append(
            f"{key}={path!r} is {os.path.getsize(path)} bytes but {side} says {count} {saved_dtype} tokens; "
            f"regenerate it"
        )
    return problems
