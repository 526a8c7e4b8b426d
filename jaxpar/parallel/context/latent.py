"""All-gather context parallelism that moves the latents keys and values are expanded from.

Multi-head latent attention (DeepSeek-V3) leaves each token a compressed latent and a RoPE key
(kv_lora_rank + qk_rope_head_dim numbers) from which every head's key and value are up-projected.
Instead of all-gathering the expanded K and V over `context` (heads x (qk + v) numbers per token,
`local.all_gather_attention_local`), `latent_attention` all-gathers the latents, up-projects the
whole sequence's keys and values on every rank (`expand`, the model's), and attends with this
rank's queries (`local.flash_attention_local`). Per token that trades the model's key / value
up-projection (c times: every rank expands every token) for far fewer bytes over `context`.

The backward recomputes the gather and the expansion (`jax.checkpoint`: nothing of the whole
sequence is kept between forward and backward, as in the K/V all-gather kernel), and the gather's
transpose reduce-scatters the latents' gradients (fp32 of latent width, not of K and V). The
up-projection's weights enter the shard_map as one copy per context rank (a leading `context`
axis), so each rank's partial weight gradient leaves it and the partitioner sums them. Proven equal
to one device by tests/models/test_families_degeneracy.py (DeepSeek-V3 under context all_gather);
its bytes against the K/V gather by tests/analysis/test_analysis_deepseek_v3.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.axes import CONTEXT
from jaxpar.manual import manual_axes, manual_spec
from jaxpar.parallel.context.local import flash_attention_local
from jaxpar.sharding import is_logical_names


def _gather(x):
    return jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)


def latent_attention_local(q, latents, weights, positions, segment_ids, *, expand, block):
    """Per device, inside a shard_map manual over `context`: this rank's q [B, S/c, H, D] against
    the keys and values `expand(gathered latents, weights)` -> (k, v) [B, S, H, D] makes of every
    rank's latents (a tuple of [B, S/c, ...]); positions / segment ids [B, S/c] (segments or None)."""

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def attend(q, latents, weights):
        k, v = expand(tuple(_gather(x) for x in latents), weights)
        kv_seg = None if segment_ids is None else _gather(segment_ids)
        return flash_attention_local(q, k, v, positions, _gather(positions), q_seg=segment_ids, kv_seg=kv_seg,
                                     block_q=block, block_kv=block)

    return attend(q, latents, weights)


def latent_attention(q, latents, latent_names, weights, weight_names, expand, positions, *, rules, plan, segment_ids=None):
    """The global view: q [B, S, H, D] and `latents` laid out by the rules table (`latent_names`:
    each one's logical names), `weights` the up-projection's parameters (`weight_names`: theirs).
    Inside a shard_map already manual over `context` (the pipeline engine) the per-device path runs
    directly; otherwise one is entered, manual over context, the batch axes and the heads' axes."""
    block = plan.context.block
    local = functools.partial(latent_attention_local, expand=expand, block=block)
    if CONTEXT in manual_axes():
        return local(q, latents, weights, positions, segment_ids)
    mesh = rules.mesh
    heads = tuple(rules.table["act_heads"])
    rows = rules.spec(("batch",))[0]
    batch = () if rows is None else rows if isinstance(rows, tuple) else (rows,)
    manual = frozenset({CONTEXT, *batch, *heads})
    spec = functools.partial(manual_spec, rules, manual=manual)
    c = mesh.shape[CONTEXT]
    # One copy of the weights per context rank: its gradient is this rank's part (summed outside).
    copies = jax.tree.map(lambda w: jnp.broadcast_to(w[None], (c,) + w.shape), weights)
    copy_specs = jax.tree.map(lambda n: P(CONTEXT, *spec(n)), weight_names, is_leaf=is_logical_names)
    row_spec = spec(("batch", "seq"))
    sharded = jax.shard_map(
        lambda q, latents, copies, pos, seg: local(q, latents, jax.tree.map(lambda w: w[0], copies), pos, seg),
        mesh=mesh,
        in_specs=(spec(("batch", "seq", "act_heads", "head_dim")), tuple(spec(n) for n in latent_names), copy_specs,
                  row_spec, row_spec),
        out_specs=spec(("batch", "seq", "act_heads", "head_dim")),
        axis_names=manual,
        check_vma=False,  # as `sharded.context_attention`
    )
    return sharded(q, tuple(latents), copies, positions, segment_ids)
