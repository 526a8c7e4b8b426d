"""Layer stacks as pipeline stages: the `[L, ...]` storage layout and any split of it into stages.

Storage never changes: parameters (and checkpoints) keep their mesh-independent `[L, ...]`
stacks, so a checkpoint moves between stage splits and meshes unchanged. When `pipeline` divides
L the rules table shards the stack over `pipeline` in equal contiguous blocks (rank q holds
layers [q·c, (q+1)·c), c = L/p); otherwise the stack is replicated over `pipeline` (jax arrays
cannot be split unevenly), which costs p× the layer memory and one all-reduce of the layer
gradients over `pipeline` per step — pick L divisible by p for large models.

A split gives global stage s n_s consecutive layers; the schedule's stage map places s on a rank
r as its local virtual stage u (`table.Schedule.stages`: u = s // p on r = s % p for the
modular map; r and 2p - 1 - r share rank r in a V shape). Inside the engine's `shard_map` each
rank builds its staged view [v, Lmax, ...] (Lmax = the largest n_s) from its storage block:
layers it owns are gathered locally; layers another rank owns arrive by one `ppermute` per rank
distance d (every rank sends what rank r + d needs from it, padded to the largest such count).
Entries past n_s are padding (a copy of some layer): the engine has one branch per distinct stage
length, whose layer scan runs over the first n_s entries only (a static slice), so a stage with
fewer layers does proportionally less work and padding gets no gradient. (Measured instead: one
scan over Lmax with a `lax.cond` skipping the padding; on CPU a skipped layer still cost ~40 ms
of a real layer's ~70 ms in the backward.) Gradients go back by the transpose of the same
exchange (`jax.linear_transpose`). An equal split with v = 1 on the modular map is a free
reshape; any other split or map moves only the layers whose stage is not on their storage rank,
every step (e.g. L = 8, p = 2, split 3 + 5: one layer's parameters there and its gradient back;
a V shape with v = 2: the second half of each rank's stages comes from the mirrored rank).

Chosen over storing the staged layout in the train state (mesh-dependent shapes: checkpoints,
HF export and the optimizer would all need converting) and over a storage split that follows
the stage split (jax shards only evenly). Proven equal to one device by `tests/test_pipeline.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.axes import PIPELINE
from jaxpar.parallel.pipeline.table import StageMap, modular_stages


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Static index tables (numpy, per rank) for one split of L layers on p ranks × v stages."""

    num_ranks: int
    virtual_stages: int
    split: tuple  # layers per global stage
    sharded: bool  # storage split over `pipeline` (L % p == 0)
    max_layers: int  # Lmax
    lengths: tuple  # the distinct stage lengths, ascending (one engine branch each)
    shifts: tuple  # ((d, K_d), ...): ppermute distance and padded count, only those with K_d > 0
    tables: dict  # name -> int32/bool array with a leading rank axis [p, ...]
    stages: StageMap = ()  # global stage -> (rank, local virtual stage)

    @property
    def identity(self) -> bool:
        """The staged view is the storage block itself (equal split, v = 1, stage s on rank s):
        a free reshape."""
        return (
            self.sharded and self.virtual_stages == 1 and len(set(self.split)) == 1
            and self.stages == modular_stages(self.num_ranks, 1)
        )


def stage_layout(split, p: int, v: int, stages: StageMap | None = None) -> StageLayout:
    """The index tables for `split` (layers per global stage) on p ranks × v, each stage on the
    (rank, local virtual stage) `stages` gives it (default `modular_stages`)."""
    stages = modular_stages(p, v) if stages is None else stages
    layers = sum(split)
    sharded = layers % p == 0
    block = layers // p if sharded else layers
    lmax = max(split)
    lengths = tuple(sorted(set(split)))
    starts = np.cumsum((0,) + tuple(split))[:-1]
    needs = {}  # rank -> [(slot, layer)] with slot = u·Lmax + j
    length = np.zeros((p, v), np.int32)  # index into `lengths` of each (rank, virtual stage)
    for s, (start, n) in enumerate(zip(starts, split)):
        r, u = stages[s]
        length[r, u] = lengths.index(n)
        needs.setdefault(r, []).extend((u * lmax + j, int(start + j)) for j in range(n))

    def owner(layer):
        return layer // block if sharded else None

    # What rank q sends rank (q + d) % p, in the receiver's slot order.
    sends = {d: {q: [] for q in range(p)} for d in range(1, p)}
    for r, pairs in needs.items():
        for _, layer in pairs:
            q = owner(layer)
            if q is not None and q != r:
                sends[(r - q) % p][q].append(layer)
    shifts = tuple((d, max(len(x) for x in sends[d].values())) for d in range(1, p))
    shifts = tuple((d, k) for d, k in shifts if k > 0)
    pool = np.zeros((p, v * lmax), np.int32)  # padding slots read entry 0 (some real layer)
    tables = {"length": length, "pool": pool}
    for d, k in shifts:
        send = np.zeros((p, k), np.int32)
        for q, sent in sends[d].items():
            send[q, : len(sent)] = [layer - q * block for layer in sent]
        tables[f"send{d}"] = send
    offsets, at = {}, block
    for d, k in shifts:
        offsets[d] = at
        at += k
    for r, pairs in needs.items():
        for slot, layer in pairs:
            q = owner(layer)
            if q is None:
                pool[r, slot] = layer
            elif q == r:
                pool[r, slot] = layer - r * block
            else:
                d = (r - q) % p
                pool[r, slot] = offsets[d] + sends[d][q].index(layer)
    return StageLayout(p, v, tuple(split), sharded, lmax, lengths, shifts, tables, tuple(stages))


def to_stages(local_layers, rank_tables: dict, layout: StageLayout):
    """Inside the engine's shard_map: this rank's storage block (a tree of [c, ...] or [L, ...]
    leaves) → its staged view [v, Lmax, ...]. `rank_tables` are `layout.tables` with the rank
    axis sharded away ([1, ...] each)."""
    p, v, lmax = layout.num_ranks, layout.virtual_stages, layout.max_layers

    def one(a):
        if layout.identity:
            return a.reshape(1, *a.shape)
        parts = [a]
        for d, _ in layout.shifts:
            sent = jnp.take(a, rank_tables[f"send{d}"][0], axis=0)
            parts.append(jax.lax.ppermute(sent, PIPELINE, [(q, (q + d) % p) for q in range(p)]))
        pool = jnp.concatenate(parts) if len(parts) > 1 else a
        return jnp.take(pool, rank_tables["pool"][0], axis=0).reshape(v, lmax, *a.shape[1:])

    return jax.tree.map(one, local_layers)


def from_stages(staged_grads, like, rank_tables: dict, layout: StageLayout):
    """The transpose of `to_stages`: staged gradients [v, Lmax, ...] → this rank's storage block,
    padding dropped. `like` holds arrays shaped and typed like the block (fp32)."""
    (local,) = jax.linear_transpose(lambda t: to_stages(t, rank_tables, layout), like)(staged_grads)
    return local
