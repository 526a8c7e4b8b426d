"""The dots the cost model prices for context parallelism's attention are the dots the kernel runs.

`efficiency.context_block_shape` says what one block pair of the blockwise kernels
(`jaxpar.parallel.context.blockwise`) multiplies as one kernel: the QK^T dot's rows, key chunk and
batch (the microbatch's rows x the device's KV heads). Here the kernel itself is traced
(`jax.make_jaxpr` of `flash_attention_local`, the computation all_gather runs on the gathered keys
and a ring step on one received block) and every dot_general in it is read off the jaxpr: each is
one of the two dots of a block pair, QK^T of exactly the priced shape or PV its transpose, none is
per head, and each writes results of the priced element size (fp32). No compilation: a trace of
tiny shapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from jaxpar.analysis.cost.efficiency import BLOCK_RESULT_BYTES, context_block_shape
from jaxpar.analysis.cost.layout import Layout
from jaxpar.parallel.context.local import flash_attention_local
from tests.support import tiny

SEQ, C, BLOCK, ROWS = 128, 2, 32, 4


def _layout(impl: str) -> Layout:
    config = tiny.with_overrides(
        tiny.llama({"seq_len": SEQ, "global_batch_size": ROWS, "compute_dtype": "bfloat16"}, max_position_embeddings=SEQ),
        {"context": C}, parallel={"context_impl": impl, "context_block_size": BLOCK},
    )
    return Layout.from_config(config, C, target="gpu")


def _dots(jaxpr) -> list[tuple[int, tuple[int, int], int, int]]:
    """(batch, (m, n) sorted, k, result bytes) of every dot_general in `jaxpr` and the jaxprs inside it (scan, cond,
    map): a GEMM's cost is the same either way round, and einsum picks the operand order."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            free = lambda shape, used: math.prod(d for i, d in enumerate(shape) if i not in used)  # noqa: E731
            mn = tuple(sorted((free(lhs, (*lc, *lb)), free(rhs, (*rc, *rb)))))
            size = eqn.outvars[0].aval.dtype.itemsize
            out.append((math.prod(lhs[i] for i in lb), mn, math.prod(lhs[i] for i in lc), size))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    out += _dots(inner)
    return out


@pytest.mark.parametrize("impl, keys", [("all_gather", SEQ), ("ring", SEQ // C)])
def test_each_priced_block_dot_is_one_dot_of_the_kernel(impl, keys):
    layout = _layout(impl)
    m, n, batch = context_block_shape(layout)
    rows, heads, kv_heads, d = layout.rows // layout.microbatches, layout.heads, layout.kv_heads, layout.head_dim
    q = jnp.zeros((rows, SEQ // C, heads, d), jnp.bfloat16)
    kv = jnp.zeros((rows, keys, kv_heads, d), jnp.bfloat16)
    traced = jax.make_jaxpr(lambda q, k, v: flash_attention_local(
        q, k, v, jnp.arange(SEQ // C), jnp.arange(keys), block_q=BLOCK, block_kv=BLOCK))(q, kv, kv)
    dots = set(_dots(traced.jaxpr))
    # QK^T ([m, d] x [d, n]) and PV ([m, n] x [n, d]), each batched over rows x KV heads.
    out = BLOCK_RESULT_BYTES
    assert dots == {(batch, tuple(sorted((m, n))), d, out), (batch, tuple(sorted((m, d))), n, out)}
