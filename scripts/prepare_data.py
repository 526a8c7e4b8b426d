"""Tokenize text into the flat binary `tokens` format for `data.source="tokens"`.

  python scripts/prepare_data.py --tokenizer=/path/to/tokenizer_dir --input=corpus_dir \
      [--input=more.jsonl ...] --output=/data/corpus.bin [--dtype=uint16|uint32] [--overwrite]

Inputs: text files (one document each), .jsonl (one per line) and .json / .parquet / .arrow files
(one per record), each record's --text_field. Writes OUTPUT (token ids, each document wrapped in the
tokenizer's special tokens, EOS last), OUTPUT.offsets.npy (where each document starts; the run cuts
the file into documents by it) and OUTPUT.json (dtype, vocab_size, num_tokens, ...); existing ones
are replaced only with --overwrite. Input is UTF-8: undecodable bytes become U+FFFD and are counted
and reported; a file with more than --max_undecodable of them (binary, another encoding) is refused.
Train on it with --config.data.source=tokens
--config.data.path=OUTPUT --config.data.token_dtype=<the dtype printed at the end>.
"""

import sys

from absl import app, flags

from jaxpar.data.prepare import DTYPES, MAX_UNDECODABLE, PrepareError, prepare, sidecar_path, undecodable_note

_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Local directory of a transformers tokenizer.")
_INPUT = flags.DEFINE_multi_string(
    "input", None, "Text, .jsonl, .json, .parquet or .arrow file, or a folder (repeatable; commas also split)."
)
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "The field of a record that holds its text.")
_OUTPUT = flags.DEFINE_string("output", None, "Token file to write (its sidecar goes to OUTPUT.json).")
_DTYPE = flags.DEFINE_enum("dtype", None, list(DTYPES), "Token dtype; default: the smallest that holds the vocabulary.")
_PROGRESS = flags.DEFINE_boolean("progress", True, "Show a progress bar.")
_OVERWRITE = flags.DEFINE_boolean("overwrite", False, "Replace an existing OUTPUT and its sidecar.")
_MAX_UNDECODABLE = flags.DEFINE_float(
    "max_undecodable", MAX_UNDECODABLE, "Largest fraction of a file's bytes that may be non-UTF-8 (replaced by U+FFFD)."
)
flags.mark_flags_as_required(["tokenizer", "input", "output"])


def main(argv):
    del argv
    inputs = [part for entry in _INPUT.value for part in entry.split(",") if part]
    try:
        meta = prepare(
            _TOKENIZER.value, inputs, _OUTPUT.value, _DTYPE.value, progress=_PROGRESS.value,
            overwrite=_OVERWRITE.value, max_undecodable=_MAX_UNDECODABLE.value,
            text_field=_TEXT_FIELD.value,
        )
    except PrepareError as e:
        sys.exit(f"prepare_data: {e}")
    if (note := undecodable_note(meta)) is not None:
        print(f"prepare_data: warning: {note}", file=sys.stderr)
    print(
        f"wrote {meta['num_tokens']} tokens ({meta['num_documents']} documents, vocab {meta['vocab_size']}) as "
        f"{meta['dtype']} to {_OUTPUT.value} and {sidecar_path(_OUTPUT.value)}; train with --config.data.source=tokens "
        f"--config.data.path={_OUTPUT.value} --config.data.token_dtype={meta['dtype']}"
    )


if __name__ == "__main__":
    app.run(main)
