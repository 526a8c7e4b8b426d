"""Expert parallelism: send each routed token to the device holding its expert, compute, send back.

`moe_ffn` gets the global [B, S, D] activations with the router's choices (ids, weights [B, S, k])
and enters a `jax.shard_map` that is manual over the batch axes (`data`, `expert`); `tensor` stays
with the partitioner, so the experts' hidden dimension is tensor-sharded as in the dense MLP. (Not
over `expert` alone: with `data` left to the partitioner, Shardy all-gathers the data-sharded rows
in front of every all-to-all, so each data replica would dispatch its whole data group's tokens.)
With context parallelism the dropless mode keeps the sequence split over `context` (manual too:
a token's output does not depend on which tokens share its device); capacity mode needs whole
rows and leaves it to the partitioner, which gathers it. Inside, a device holds R = B / (data·ep)
rows (of S / context tokens when dropless) and E / ep experts, ep = mesh.expert, and:

  1. sorts its (token, expert) assignments by expert (stable: token order within an expert);
  2. packs them into fixed-size buffers, one block per destination expert device;
  3. `all_to_all` over `expert` (block j goes to device j; received blocks are indexed by source);
  4. runs its local experts on what arrived;
  5. `all_to_all` back, picks each assignment's output out of the returned blocks, un-sorts, and
     sums each token's k outputs weighted by the router.
With ep = 1 steps 2, 3 and 5 vanish: no collective at all. With no mesh (rules None) the same
local code runs on the whole batch, without shard_map; inside a caller's shard_map that is already
manual over the batch axes (the pipeline engine) it runs on that device's rows and experts.

Two modes:
- capacity (`capacity` C > 0), grouped per sequence: an expert takes the first C assignments of each
  row (in token order) and drops the rest (output zero). Buffers [R, E, C, D]; experts run as one
  batched matmul over their slots. Drops never depend on the mesh: results are identical on any mesh.
- dropless (`capacity` 0), grouped per device: all R·S·k assignments sorted by expert. Send buffers
  [ep, M, D] with M = R·S·min(k, E/ep), the most one device can send another, so nothing is ever
  dropped (dense worst-case buffers, since the CPU backend has no `ragged_all_to_all`). The receiver
  lays the rows of all sources out by local expert and runs the experts with `grouped_matmul`
  (`jaxpar.kernels`): `jax.lax.ragged_dot` on GPU/TPU over the rows packed, a tiled loop on CPU
  over each expert's rows padded to whole tiles. With ep = 1 the layout is gathered straight from
  the tokens (one gather, as the sort needed anyway) and each assignment's output read back from it.

Collectives: two all-to-alls over `expert` per MoE layer forward (dispatch and return), of
[R, E, C, D] (capacity) or [ep, M, D] (dropless) per device, and two more in the backward; the
expert weights' gradients are summed over the batch axes they are replicated on.

Proven equal to a per-token loop by `tests/models/test_moe.py` and to one device by
`tests/models/test_moe_degeneracy.py`.

Not implemented: a `ragged_all_to_all` exchange that sends only the filled part of each block
(GPU/TPU only; there is no multi-GPU machine here to test it on).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.axes import DATA, EXPERT, PIPELINE
from jaxpar.kernels.fp8 import fp8_input, fp8_output, fp8_weight
from jaxpar.kernels.grouped_matmul import (
    group_tile,
    grouped_matmul,
    grouped_matmul_pair,
    layout_rows,
    resolve_impl,
)
from jaxpar.manual import manual_axes


def overlap_checks(config, mesh: dict) -> list[str]:
    """`parallel.expert_overlap`: whole rows per chunk on every device, outside a pipeline."""
    if not config.parallel.expert_overlap or mesh[EXPERT] == 1:
        return []
    if mesh.get(PIPELINE, 1) > 1:
        return ["parallel.expert_overlap=True is not supported with mesh.pipeline > 1 yet"]
    train = config.train
    rows = train.global_batch_size // (mesh[DATA] * mesh[EXPERT] * max(1, train.grad_accum))
    if rows % 2:
        return [f"parallel.expert_overlap=True splits each device's rows in two, but it holds {rows} per microbatch "
                f"(train.global_batch_size / (mesh.data x mesh.expert x train.grad_accum)); make that even"]
    return []


def checks(experts: int, mesh: dict, key: str) -> list[str]:
    """Experts (`key`: the config key naming their count) must split evenly over the expert axis."""
    ep = mesh[EXPERT]
    if experts % ep:
        return [f"{key}={experts} is not divisible by mesh.{EXPERT}={ep}; change {key} or mesh.{EXPERT}"]
    return []


def dropped_assignments(chosen, capacity: int):
    """How many (token, expert) assignments overflow their expert's capacity, over the batch;
    `chosen` [B, S, E] marks each token's experts."""
    if capacity == 0:
        return jnp.zeros((), jnp.float32)
    per_row = jnp.sum(chosen, axis=1)  # [B, E]
    return jnp.sum(jnp.maximum(per_row - capacity, 0)).astype(jnp.float32)


def swiglu(gate, up):
    """The experts' default activation: silu(x W_gate) · x W_up."""
    return jax.nn.silu(gate) * up


def moe_ffn(x, ids, weights, experts, *, num_experts: int, capacity: int, rules, matmul_impl: str | None = None,
            activation=swiglu, fp8=None, chunks: int = 1):
    """Sum over k of weights[..., k] · expert_{ids[..., k]}(x), for x [B, S, D], ids / weights
    [B, S, k]; `experts` = (gate [E, D, F], up [E, D, F], down [E, F, D]) gated-MLP weights, and
    optionally their biases (gate [E, F], up [E, F], down [E, D]) after them (gpt-oss);
    `activation(gate, up)` the hidden state (default `swiglu`). `rules` None: no mesh.
    `matmul_impl`: see `grouped_matmul` (dropless only). `fp8`: the experts' matmuls in FP8 with
    this scaling (`jaxpar.kernels.fp8`, quantize-dequantize form; None: compute dtype). `chunks` > 1
    (`parallel.expert_overlap`): each device's rows in that many chunks, each dispatched, computed and
    returned on its own (`_in_chunks`)."""
    local = _in_chunks(functools.partial(
        _capacity_local if capacity else _dropless_local,
        num_experts=num_experts,
        capacity=capacity,
        matmul_impl=matmul_impl,
        activation=activation,
        fp8=fp8,
    ), chunks)
    if rules is None:
        return local(x, ids, weights, *experts, ep=1, exchange=None)
    ep = rules.mesh.shape[EXPERT]
    if EXPERT in manual_axes():  # already per device (the pipeline engine's shard_map): rows and experts are local
        return local(x, ids, weights, *experts, ep=ep, exchange=_all_to_all if ep > 1 else None)
    # Manual over the batch axes (data and expert), not expert alone (see the module docstring);
    # tensor stays auto. The step's per-replica gradient accumulation runs this under
    # vmap(spmd_axis_name="data") with `data` dropped from the batch rule; jax 0.10.2 then marks
    # values as varying over `data` and its varying-axes checks fail (even with `data` manual),
    # hence check_vma=False. Gradients of the replicated expert weights are still summed over
    # `data` by shard_map's transpose.
    # Dropless: each token's output does not depend on which tokens share its device, so the
    # sequence stays split (over `context`, by the rules) and manual too, not gathered for the sort.
    # Capacity keeps the first C per whole row: the sequence stays whole there.
    rows = rules.spec(("batch",) if capacity else ("batch", "seq"))
    batch_axes = () if rows[0] is None else rows[0] if isinstance(rows[0], tuple) else (rows[0],)
    seq_axes = () if capacity or rows[1] is None else rows[1] if isinstance(rows[1], tuple) else (rows[1],)
    if EXPERT not in batch_axes:
        raise ValueError(f"expert parallelism needs {EXPERT!r} among the batch axes, got {batch_axes}")
    if math.prod(rules.mesh.shape[a] for a in (*batch_axes, *seq_axes)) == 1:
        # Nothing to split by hand (e.g. tensor 8 alone): a shard_map manual only over size-1 axes
        # failed to compile ("Cross-partition allreduce must be in (partial) manual partitioning
        # mode", XLA's SPMD partitioner); the partitioner handles `tensor` in the plain code.
        return local(x, ids, weights, *experts, ep=1, exchange=None)
    # The expert weights cross the shard_map boundary in fp32, so the gradient sum over `data`
    # (shard_map's transpose) is an fp32 all-reduce: more accurate than a 16-bit one, and XLA:CPU
    # crashes promoting that 16-bit all-reduce ("Invalid binary instruction opcode copy").
    compute_dtype = x.dtype
    experts = tuple(w.astype(jnp.float32) for w in experts)

    def per_device(x, ids, weights, *experts):
        experts = tuple(w.astype(compute_dtype) for w in experts)
        return local(x, ids, weights, *experts, ep=ep, exchange=_all_to_all if ep > 1 else None)

    return jax.shard_map(
        per_device,
        mesh=rules.mesh,
        in_specs=(rows,) * 3 + (P(EXPERT),) * len(experts),
        out_specs=rows,
        axis_names={*batch_axes, *seq_axes},
        check_vma=False,
    )(x, ids, weights, *experts)


def _in_chunks(local, chunks: int):
    """`local` over the rows in `chunks` independent chunks (DeepSeek's and MaxText's batch splitting):
    no chunk's all-to-all waits for another chunk's expert matmuls, so a scheduler may run one chunk's
    exchange behind the other's compute. Rows are whole sequences, so capacity mode (first C of each
    row) and dropless mode give the same outputs as without chunks. Preflight keeps the rows divisible."""
    if chunks == 1:
        return local

    def chunked(x, ids, weights, *experts, **kw):
        parts = zip(*(jnp.split(a, chunks, axis=0) for a in (x, ids, weights)))
        return jnp.concatenate([local(*part, *experts, **kw) for part in parts], axis=0)

    return chunked


def _all_to_all(a, axis: int):
    """Block j of `axis` goes to expert device j; received blocks are indexed by source device."""
    return jax.lax.all_to_all(a, EXPERT, axis, axis, tiled=True)


# ---- Per-device computation: this device's rows, all E experts' routing, E / ep local experts ----


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def _counts(ids, num_experts: int):
    """Assignments per expert of a flat id vector: a scatter-add, linear in the assignments (a
    one-hot sum is assignments × experts: 16 MB per layer at 4096 tokens, top-8, 128 experts)."""
    return jnp.zeros((num_experts,), jnp.int32).at[ids].add(1)


def _pack(sorted_rows, starts, counts, slots: int):
    """[G, slots, D] blocks from rows [N, D]: block g holds rows starts[g] .. starts[g] + counts[g] - 1
    (at most `slots` of them), zeros after."""
    slot = jnp.arange(slots)
    source = jnp.minimum(starts[:, None] + slot, sorted_rows.shape[0] - 1)  # [G, slots]
    return jnp.where((slot < counts[:, None])[..., None], sorted_rows[source], 0)


def _combine(per_assignment, weights):
    """[R·S·k, D] outputs in assignment order -> [R, S, D], each token's k outputs weighted."""
    rows, seq, k = weights.shape
    per_assignment = per_assignment.reshape(rows, seq, k, -1)
    return jnp.einsum("rskd,rsk->rsd", per_assignment, weights.astype(per_assignment.dtype))


def _capacity_local(x, ids, weights, gate, up, down, *biases, num_experts, capacity, matmul_impl, ep, exchange, activation,
                    fp8=None):
    """Capacity per sequence: buffers [R, E, C, D]; the first C assignments of a row to an expert
    (in token order) are kept, the rest dropped."""
    del matmul_impl
    rows, seq, d = x.shape
    k = ids.shape[-1]
    with jax.named_scope("moe_dispatch"):
        flat = ids.reshape(rows, seq * k)
        order = jnp.argsort(flat, axis=-1, stable=True)  # per row, by expert, then token
        expert = jnp.take_along_axis(flat, order, axis=-1)
        counts = jax.vmap(functools.partial(_counts, num_experts=num_experts))(flat)  # [R, E]
        starts = _exclusive_cumsum(counts)
        sorted_rows = jnp.take_along_axis(x, (order // k)[..., None], axis=1)  # [R, S·k, D]
        buffers = jax.vmap(functools.partial(_pack, slots=capacity))(sorted_rows, starts, counts)
        buffers = buffers.reshape(rows, ep, num_experts // ep, capacity, d)
        if exchange is not None:
            buffers = exchange(buffers, 1)  # [R, source device, local expert, C, D]
    with jax.named_scope("moe_experts"):
        slots = fp8_input(buffers, fp8)
        gated = fp8_output(jnp.einsum("rpecd,edf->rpecf", slots, fp8_weight(gate, fp8, 1)), fp8)
        lifted = fp8_output(jnp.einsum("rpecd,edf->rpecf", slots, fp8_weight(up, fp8, 1)), fp8)
        if biases:  # per local expert, broadcast over rows, sources and slots
            gated, lifted = gated + biases[0][:, None, :], lifted + biases[1][:, None, :]
        out = jnp.einsum("rpecf,efd->rpecd", fp8_input(activation(gated, lifted), fp8), fp8_weight(down, fp8, 1))
        out = fp8_output(out, fp8)
        if biases:
            out = out + biases[2][:, None, :]
    with jax.named_scope("moe_combine"):
        if exchange is not None:
            out = exchange(out, 1)  # back home: [R, destination device, local expert, C, D] = [R, E, C, D]
        out = out.reshape(rows, num_experts * capacity, d)
        rank = jnp.arange(seq * k) - jnp.take_along_axis(starts, expert, axis=-1)  # place within its expert
        picked = jnp.take_along_axis(out, (expert * capacity + jnp.minimum(rank, capacity - 1))[..., None], axis=1)
        sorted_out = jnp.where((rank < capacity)[..., None], picked, 0)
        per_assignment = jnp.take_along_axis(sorted_out, jnp.argsort(order, axis=-1)[..., None], axis=1)
        return _combine(per_assignment.reshape(rows * seq * k, d), weights)


def _dropless_local(x, ids, weights, gate, up, down, *biases, num_experts, capacity, matmul_impl, ep, exchange, activation,
                    fp8=None):
    """Dropless: all of this device's assignments sorted by expert; worst-case send buffers."""
    del capacity
    rows, seq, d = x.shape
    k = ids.shape[-1]
    impl = resolve_impl(matmul_impl)
    tokens = x.reshape(rows * seq, d)
    with jax.named_scope("moe_dispatch"):
        flat = ids.reshape(-1)  # [N = R·S·k], assignment order
        order = jnp.argsort(flat, stable=True)
        counts = _counts(flat, num_experts)  # [E]
    ffn = functools.partial(_expert_mlp, gate=gate, up=up, down=down, biases=biases, impl=impl, activation=activation, fp8=fp8)
    if exchange is None:
        # The experts read their rows straight from the tokens, in the grouped layout.
        with jax.named_scope("moe_dispatch"):
            layout = _GroupedLayout.of(flat[order][None], counts[None], impl)
            token = jnp.take(order // k, layout.source, mode="fill", fill_value=rows * seq)
            grouped = jnp.take(tokens, token, axis=0, mode="fill", fill_value=0)
        with jax.named_scope("moe_experts"):
            out = ffn(grouped, layout.sizes, layout.tile)
        with jax.named_scope("moe_combine"):
            slot = jnp.zeros_like(order).at[order].set(layout.slot[0])  # each assignment's row
            return _combine(out[slot], weights)
    local_experts = num_experts // ep
    # The most one device can receive from another: each token, at most min(k, E/ep) times.
    slots = rows * seq * min(k, local_experts)
    with jax.named_scope("moe_dispatch"):
        sorted_rows = tokens[order // k]
        device_counts = counts.reshape(ep, local_experts).sum(-1)
        device_starts = _exclusive_cumsum(device_counts)
        received = exchange(_pack(sorted_rows, device_starts, device_counts, slots), 0)  # [source, slots, D]
        received_counts = exchange(counts.reshape(ep, local_experts), 0)  # [source, local expert]
    with jax.named_scope("moe_experts"):
        out = _received_swiglu(received, received_counts, ffn, impl)
    with jax.named_scope("moe_combine"):
        out = exchange(out, 0).reshape(ep * slots, d)  # [destination, slots, D], flattened
        device = flat[order] // local_experts
        place = jnp.arange(flat.shape[0]) - device_starts[device]
        sorted_out = out[device * slots + place]
        return _combine(sorted_out[jnp.argsort(order)], weights)


class _GroupedLayout(NamedTuple):
    """Where rows go in the layout `grouped_matmul` reads: each group's rows back to back, in
    order, every group padded to a multiple of `tile` rows (zero rows), padding last.
    `slot` [sources, n]: each input row's row in the layout (rows of no group: past the end);
    `source` [layout rows]: the flat input row each layout row holds (padding: past the end);
    `sizes` [G]: the groups' padded sizes."""

    slot: jax.Array
    source: jax.Array
    sizes: jax.Array
    tile: int

    @classmethod
    def of(cls, group, counts, impl: str):
        """`group` [sources, n]: each row's group (G for padding rows), each source's rows sorted
        by group; `counts` [sources, G]: rows per group in each source. A group's rows are laid
        out source after source, padded to the tile `impl` reads (`group_tile`)."""
        sources, n = group.shape
        num_groups = counts.shape[-1]
        tile = group_tile(impl, sources * n, num_groups)
        padded = -(-counts.sum(0) // tile) * tile
        group_start = _exclusive_cumsum(padded)  # in the layout
        before = _exclusive_cumsum(counts, axis=0)  # the group's rows in earlier sources
        in_source = _exclusive_cumsum(counts, axis=-1)  # where the group starts in its source
        rows = layout_rows(sources * n, num_groups, tile)
        real = group < num_groups
        g = jnp.minimum(group, num_groups - 1)
        index = jnp.arange(n)[None, :]
        slot = group_start[g] + jnp.take_along_axis(before - in_source, g, axis=-1) + index
        slot = jnp.where(real, slot, rows)
        source = jnp.full((rows,), sources * n, jnp.int32).at[slot.reshape(-1)].set(
            jnp.arange(sources * n, dtype=jnp.int32), mode="drop"
        )
        return cls(slot, source, padded, tile)


def _received_swiglu(received, counts, ffn, impl):
    """Runs the local experts on blocks [source, slots, D], each sorted by local expert and
    zero-padded: lays all rows out by expert, computes, puts them back."""
    sources, slots, d = received.shape
    local_experts = counts.shape[-1]
    # Each slot's local expert (padding: local_experts), as a repeat of the expert ids by their
    # counts: linear in the slots (comparing every slot with every expert's start is slots × experts).
    ids = jnp.arange(local_experts + 1, dtype=jnp.int32)
    padded = jnp.concatenate([counts, slots - counts.sum(-1, keepdims=True)], axis=-1)  # [source, E/ep + 1]
    expert = jax.vmap(lambda c: jnp.repeat(ids, c, total_repeat_length=slots))(padded)  # [source, slots]
    layout = _GroupedLayout.of(expert, counts, impl)
    rows = received.reshape(sources * slots, d)
    out = ffn(jnp.take(rows, layout.source, axis=0, mode="fill", fill_value=0), layout.sizes, layout.tile)
    return jnp.take(out, layout.slot.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(sources, slots, d)


def _expert_mlp(rows, sizes, tile, *, gate, up, down, biases, impl, activation, fp8=None):
    """Each expert's gated MLP on its rows, in `grouped_matmul`'s layout (padding rows: zero in,
    never read out, so the biases they receive go nowhere)."""
    gate_up = grouped_matmul_pair(fp8_input(rows, fp8), fp8_weight(gate, fp8, 1), fp8_weight(up, fp8, 1), sizes, impl, tile)
    gated, lifted = fp8_output(gate_up[..., 0], fp8), fp8_output(gate_up[..., 1], fp8)
    down = functools.partial(_fp8_down, down=fp8_weight(down, fp8, 1), sizes=sizes, impl=impl, tile=tile, fp8=fp8)
    if not biases:
        return down(activation(gated, lifted))
    group = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=rows.shape[0])  # each row's expert
    gated, lifted = gated + biases[0][group], lifted + biases[1][group]
    return down(activation(gated, lifted)) + biases[2][group]


def _fp8_down(hidden, *, down, sizes, impl, tile, fp8):
    return fp8_output(grouped_matmul(fp8_input(hidden, fp8), down, sizes, impl, tile), fp8)
