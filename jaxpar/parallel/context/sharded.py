"""The global-view entry point (`context_attention`) and causal load balancing of the sequence."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.axes import CONTEXT, PIPELINE, TENSOR
from jaxpar.manual import manual_axes
from jaxpar.parallel.context.local import (
    DEFAULT_BLOCK,
    all_gather_attention_local,
    all_to_all_attention_local,
    ring_attention_local,
)
from jaxpar.parallel.context.window import Reach, resolve

IMPLS = {
    "all_gather": all_gather_attention_local,
    "ring": ring_attention_local,
    "all_to_all": all_to_all_attention_local,
}


def context_attention(
    q,
    k,
    v,
    positions,
    *,
    mesh,
    impl: str,
    context_axis: str = CONTEXT,
    head_axis: str | None = TENSOR,
    batch_axes: tuple[str, ...] = (),
    vmapped_axes: tuple[str, ...] = (),
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK,
    block_kv: int = DEFAULT_BLOCK,
    segment_ids=None,
    window=None,
    sinks=None,
    softcap: float | None = None,
    reach=None,
):
    """Causal attention with the sequence sharded over `context_axis`; call under jit.

    q [B, S, Hq, D], k / v [B, S, Hkv, D] (Hq a multiple of Hkv), positions int32 [B, S] or [S]
    (shared by every row): each token's true position; the mask is key position <= query
    position, whatever the sequence order. `segment_ids` int32 [B, S] (packed documents, in the
    same order; 0: padding): a query sees only keys of its own segment, padding nothing.
    Returns [B, S, Hq, D] laid out like q.

    The shard_map is manual over `context_axis`, `head_axis` (heads sharded over it; skipped if
    the mesh has no such axis), `batch_axes` (the batch dimension sharded over them) and
    `vmapped_axes`; every other mesh axis stays Auto. The batch axes must be manual: left to the
    partitioner, a batch sharded over an Auto axis is all-gathered in front of every all-gather /
    all-to-all over `context` (Shardy, jax 0.10.2, measured; a sharding constraint inside does not
    help). `vmapped_axes`: the spmd_axis_name of a vmap around this call (the train step's
    per-replica accumulation uses "data"): vmap adds it to the specs but not to the manual axes,
    and the lowering then fails on a shape mismatch, so it must be named here.

    `scale` defaults to 1/sqrt(D); `block_q` / `block_kv` bound the local score chunks. A layer's
    attention pattern (`jaxpar.parallel.context.local`): `window` int32 scalar (0: full; may be
    traced), `sinks` [Hq] (sharded over the head axis like q's heads), `softcap` a float.
    `reach` (`window.Reach`, ring and all_gather): the sequence is laid out in text order
    (contiguous, or load-balanced as `load_balance_order`) and windows up to `reach.span` need only
    the ranks they reach; a window given as a Python int decides the exchange statically.
    """
    if impl not in IMPLS:
        raise ValueError(f"context attention impl {impl!r}: expected one of {sorted(IMPLS)}")
    c = mesh.shape[context_axis]
    heads = head_axis if head_axis in mesh.axis_names else None
    t = mesh.shape[heads] if heads else 1
    b, s, hq, _ = q.shape
    hkv = k.shape[2]
    if s % c:
        raise ValueError(f"context attention: sequence length {s} is not divisible by mesh.{context_axis}={c}")
    if hq % t or hkv % t:
        raise ValueError(f"context attention: {hq} query / {hkv} key-value heads not divisible by mesh.{heads}={t}")
    if impl == "all_to_all" and ((hq // t) % c or ((hkv // t) % c and c % (hkv // t))):
        raise ValueError(
            f"context attention all_to_all: {hq // t} query heads per device must be divisible by "
            f"mesh.{context_axis}={c}, and {hkv // t} key/value heads divisible by it or a divisor of it; "
            "use impl ring or all_gather"
        )
    if positions.shape not in ((b, s), (s,)):
        raise ValueError(f"context attention: positions {positions.shape} must be [batch, seq] {(b, s)} or [seq]")
    if segment_ids is not None and segment_ids.shape != (b, s):
        raise ValueError(f"context attention: segment_ids {segment_ids.shape} must be [batch, seq] {(b, s)}")

    batch = tuple(batch_axes) or None
    spec = P(batch, context_axis, heads, None)
    local = functools.partial(IMPLS[impl], axis_name=context_axis, scale=scale, block_q=block_q, block_kv=block_kv)
    pos_spec = P(batch, context_axis) if positions.ndim == 2 else P(context_axis)
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"context attention: sinks {sinks.shape} must be [query heads] {(hq,)}")
    reach = resolve(reach, window)
    window = None if window is None else jax.numpy.asarray(window, jax.numpy.int32)
    sharded = jax.shard_map(
        lambda q, k, v, pos, seg, window, sinks: local(
            q, k, v, pos, pos, q_seg=seg, kv_seg=seg, window=window, sinks=sinks, softcap=softcap, reach=reach
        ),
        mesh=mesh,
        in_specs=(spec, spec, spec, pos_spec, P(batch, context_axis), P(), P(heads)),
        out_specs=spec,
        axis_names=frozenset({context_axis, *batch_axes, *vmapped_axes} | ({heads} if heads else set())),
        # Under the train step's vmap(spmd_axis_name="data") jax 0.10.2's varying-axes checks
        # fail ("pvary is a invariant->variant collective"), as in parallel/expert.py.
        check_vma=False,
    )
    return sharded(q, k, v, positions, segment_ids, window, sinks)


def model_attention(q, k, v, positions, *, rules, plan, segment_ids=None, window=None, sinks=None, softcap=None,
                    scale=None, span=None):
    """What the model's attention layer runs when `plan.context` is set (a `ContextPlan`): q, k, v,
    positions and segment ids (or None) [B, S] laid out by the rules table (sequence over `context`, heads over
    `tensor`). Inside a shard_map already manual over `context` (the pipeline engine) the
    sequence is this rank's shard and the per-device kernel runs directly; otherwise
    `context_attention` enters one, manual over the batch axes the rules name. (Gradient
    accumulation under context parallelism runs the model inside a shard_map manual over
    `context` too: `jaxpar.parallel.context.accumulation`.) `window`, `sinks`, `softcap`, `scale`:
    the layer's attention pattern, as `context_attention` takes it; `span` the model's
    sliding_window (static): sliding layers then exchange only what their window reaches, except
    inside the pipeline engine, whose stages run layers of different kinds at once (`window.py`)."""
    ctx = plan.context
    reach = None
    if span and window is not None and PIPELINE not in manual_axes():
        reach = Reach(int(span), bool(ctx.load_balance))
    pattern = dict(window=window, sinks=sinks, softcap=softcap, scale=scale, reach=reach)
    if CONTEXT in manual_axes():
        # Under ZeRO-3 the engine leaves the batch axes to the partitioner, which then gathers the
        # microbatch over them in front of these collectives (correct, more traffic); a nested
        # shard_map over the batch axes here fails to lower in jax 0.10.2 (the custom VJP's
        # residuals get the wrong local shape).
        local = IMPLS[ctx.impl]
        return local(q, k, v, positions, positions, axis_name=CONTEXT, q_seg=segment_ids, kv_seg=segment_ids,
                     block_q=ctx.block, block_kv=ctx.block, **pattern)
    rows = rules.spec(("batch",))[0]
    batch_axes = () if rows is None else rows if isinstance(rows, tuple) else (rows,)
    return context_attention(
        q, k, v, positions, mesh=rules.mesh, impl=ctx.impl, batch_axes=batch_axes,
        block_q=ctx.block, block_kv=ctx.block, segment_ids=segment_ids, **pattern,
    )


def load_balance_order(seq_len: int, c: int) -> np.ndarray:
    """Permutation of range(seq_len) (new position i holds old token order[i]) such that,
    sharded contiguously over c ranks, rank r holds chunks r and 2c-1-r of 2c equal chunks: every
    rank then has the same causal work (the Megatron / Llama 3 layout)."""
    if seq_len % (2 * c):
        raise ValueError(
            f"train.seq_len={seq_len} must be divisible by 2 x mesh.context = {2 * c} for causal load balancing"
        )
    chunks = np.arange(seq_len).reshape(2 * c, seq_len // (2 * c))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * c - 1 - r]]) for r in range(c)])


def load_balance_inverse(seq_len: int, c: int) -> np.ndarray:
    """Inverse of `load_balance_order`: x_balanced[..., inverse] restores the original order."""
    return np.argsort(load_balance_order(seq_len, c))
