"""Context parallelism (placeholder docstring)."""

from jaxpar.parallel.context.local import (
    all_gather_attention_local,
    all_to_all_attention_local,
    flash_attention_local,
    ring_attention_local,
)
from jaxpar.parallel.context.sharded import (
    CONTEXT,
    IMPLS,
    TENSOR,
    context_attention,
    load_balance_inverse,
    load_balance_order,
)
