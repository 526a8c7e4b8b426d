"""Context parallelism: causal attention with the sequence sharded over the `context` mesh axis.

With mesh.context = c > 1 each rank holds S/c tokens of every sequence (and Hq/t, Hkv/t heads with
tensor = t). `context_attention` (global view, under jit) enters a `jax.shard_map` manual over
context, the head axis and the batch axes and runs one of three per-device implementations, also
callable directly inside a caller's own shard_map (e.g. a pipeline stage):

  impl          collectives per attention call, per device (B = local rows, H = local heads)
  all_gather    fwd: all-gather K, V -> [B, S, Hkv, D] each, positions -> [B, S] (Llama 3: only
                the KV heads travel, so GQA keeps it small). bwd: the same gathers again (the
                gathered K/V are not saved) and a reduce-scatter of dK, dV (fp32) [B, S, Hkv, D]
                -> [B, S/c, Hkv, D]. Holds the whole sequence's K/V while attending.
  ring          fwd: c-1 collective-permutes of the K, V blocks [B, S/c, Hkv, D] and positions
                [B, S/c] (neighbour to neighbour), each overlappable with a block of work.
                bwd: c-1 permutes of K, V, positions and the travelling dK, dV (fp32), then one
                more of dK, dV that brings each accumulator home. Never more than two K/V blocks.
  all_to_all    (DeepSpeed-Ulysses) fwd: all-to-alls of q [B, S/c, Hq, D], k, v [B, S/c, Hkv, D]
                into [B, S, H/c, D] (whole sequences, 1/c of the heads), one of the output back,
                an all-gather of positions [B, S]. bwd: four all-to-alls (dout in; dq, dk, dv out).
                Needs Hq and Hkv per device divisible by c.

Every implementation is a `jax.custom_vjp` (flash attention): the forward keeps an online softmax
(running max, running sum, fp32 output sum) over key blocks and saves only the local q, k, v, the
output and the log-sum-exp; the backward recomputes each score block. Queries and keys are cut
into chunks (`block_q`, `block_kv`, at most half the local length) so no score array is larger than
[B, H, block_q, block_kv] and no [S/c, S] score matrix exists; chunk pairs (and, for the ring,
whole blocks) whose keys all lie after all the queries are skipped by `lax.cond` (no collective
in the branches). The mask comes from the carried true positions, so the load-balanced order
(`load_balance_order`: rank r holds chunks r and 2c-1-r of 2c) works unchanged.

Equal to one device (`jax.nn.dot_product_attention(is_causal=True)`, unpermuted; output and dq,
dk, dv): tests/test_context_attention.py — test_matches_one_device (c = 2, 4, 8 × impls ×
balanced / contiguous, GQA), test_tensor_and_context, test_data_and_context_keep_batch_sharded,
test_under_vmap_over_data, test_local_functions_inside_callers_shard_map, test_bf16_inputs;
test_fully_masked_blocks_are_skipped proves the skipping, test_ring_moves_kv_by_collective_permute_only
and test_ring_temp_memory_falls_with_context the ring's traffic and memory.
"""

from jaxpar.parallel.context.local import (
    DEFAULT_BLOCK,
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

__all__ = [
    "CONTEXT",
    "DEFAULT_BLOCK",
    "IMPLS",
    "TENSOR",
    "all_gather_attention_local",
    "all_to_all_attention_local",
    "context_attention",
    "flash_attention_local",
    "load_balance_inverse",
    "load_balance_order",
    "ring_attention_local",
]
