"""Data pipeline: sources cut into documents, packed into mesh-independent global batches, mixed
and held out (`corpus`); the byte tokenizer and token-stream windows for tools and tests."""

from jaxpar.data.batches import BatchIterator, DocumentBatches, GlobalBatches, global_batch, process_rows, to_global
from jaxpar.data.checks import corpus_problems, validate_data_config
from jaxpar.data.sources import load_tokens
from jaxpar.data.tokenizer import ByteTokenizer

__all__ = [
    "BatchIterator",
    "ByteTokenizer",
    "DocumentBatches",
    "GlobalBatches",
    "corpus_problems",
    "global_batch",
    "load_tokens",
    "process_rows",
    "to_global",
    "validate_data_config",
]
