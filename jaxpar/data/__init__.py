"""Data pipeline: corpus sources, the byte tokenizer, and mesh-independent global batches."""

from jaxpar.data.batches import BatchIterator, GlobalBatches, global_batch, process_rows
from jaxpar.data.sources import load_tokens, validate_data_config
from jaxpar.data.tokenizer import ByteTokenizer

__all__ = [
    "BatchIterator",
    "ByteTokenizer",
    "GlobalBatches",
    "global_batch",
    "load_tokens",
    "process_rows",
    "validate_data_config",
]
