"""Context parallelism: the sequence of every activation sharded over the `context` mesh axis.

What it shards: with mesh.context = c > 1 (`ContextPlan` in the parallel plan, `plan.py`) the
rules table maps `seq` (and `act_seq`, before `tensor` under sequence parallelism) to `context`,
so each rank holds S/c tokens of every sequence: tokens, targets, positions, embeddings,
residuals, MLP activations, logits. Only attention needs other ranks' tokens. The loss permutes
the batch once into the sharded order (`sequence.py`; load balancing: rank r holds chunks r and
2c-1-r of 2c) and gives every token its true position, so RoPE, the causal mask and the
token-mean loss are unchanged. Parameters are replicated over `context`; their gradients are
summed over it like over data replicas — with gradient accumulation once per step, not per
microbatch: every (replica, context rank) accumulates its own partial gradient
(`accumulation.py`, `GradientStrategy.PER_RANK`).

The model's attention (`model_attention`) enters a `jax.shard_map` manual over context, the head
axis (`tensor`) and the batch axes (`context_attention`), or, inside the pipeline engine, whose
shard_map is already manual over `context`, calls the per-device kernel directly. Kernels, per
attention call and device (B = local rows, H = local heads):

  impl          collectives
  all_gather    fwd: all-gather K, V -> [B, S, Hkv, D] each, positions -> [B, S] (Llama 3: only
                the KV heads travel, so GQA keeps it small). bwd: the same gathers again (the
                gathered K/V are not saved) and a reduce-scatter of dK, dV (fp32) [B, S, Hkv, D]
                -> [B, S/c, Hkv, D]. Holds the whole sequence's K/V while attending.
  ring          fwd: c-1 collective-permutes of the K, V blocks [B, S/c, Hkv, D] and positions
                [B, S/c] (neighbour to neighbour), each overlappable with a block of work.
                bwd: c-1 permutes of K, V, positions and the travelling dK, dV (fp32), then one
                more of dK, dV that brings each accumulator home. Never more than two K/V blocks.
                Not inside pipeline stages on XLA:CPU (a permute in a per-rank branch deadlocks;
                preflight refuses it).
  all_to_all    (DeepSpeed-Ulysses) fwd: all-to-alls of q [B, S/c, Hq, D], k, v [B, S/c, Hkv, D]
                into [B, S, H/c, D] (whole sequences, 1/c of the heads), one of the output back,
                an all-gather of positions [B, S]. bwd: four all-to-alls (dout in; dq, dk, dv out).
                Needs Hq per device divisible by c; fewer KV heads than c are repeated first.

A sliding layer (the model's `sliding_window`, outside pipeline stages) exchanges less: ring and
all_gather move only the pieces of the ranks its window reaches, one collective-permute per shift
(`window.py`; its backward fetches them again and sends their dK, dV back).

Every implementation is a `jax.custom_vjp` (flash attention): the forward keeps an online softmax
(running max, running sum, fp32 output sum) over key blocks and saves only the local q, k, v, the
output and the log-sum-exp; the backward recomputes each score block. Queries and keys are cut
into chunks (`block_q`, `block_kv` = parallel.context_block_size, at most half the local length)
so no score array is larger than [B, H, block_q, block_kv] and no [S/c, S] score matrix exists;
chunk pairs (and, for the ring, whole blocks) whose keys all lie after all the queries are
skipped by `lax.cond` (no collective in the branches). The mask comes from the carried true
positions, so the load-balanced order works unchanged.

Equal to one device through the production train step: tests/parallel/test_context.py —
test_matches_single_device (c = 2, 4, 8, every impl balanced and contiguous, with data, tensor +
SP, per-replica accumulation, ZeRO-3, Mixtral with expert 2, pipeline 1f1b and interleaved),
test_ring_step_moves_kv_by_collective_permute_only, test_ring_step_temp_memory_falls_with_context.
The kernels alone against `jax.nn.dot_product_attention(is_causal=True)`:
tests/parallel/test_context_attention.py (test_matches_one_device, test_tensor_and_context,
test_under_vmap_over_data, ...; test_fully_masked_blocks_are_skipped).
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
