"""Layer stacks as pipeline stages: the `[L, ...]` storage layout and any split of it into stages.

Storage keeps `[L, ...]` stacks (in the natural order, or permuted along L: below); checkpoints
always hold the natural order, so they move between stage splits, schedules and meshes unchanged. When `pipeline` divides
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

Storage in the schedule's order (`storage_order`, `PipelineOptions.layers_in_schedule_order`):
the same [L, ...] stacks, permuted so that rank r's block holds its own stages' layers in local
stage order; with an equal split (any v, any stage map) the staged view is then a free reshape
and no layer moves. The plan stores every interleaved and V layout so (`options.
stores_in_schedule_order`: v > 1 and L divisible by p), and the train state holds its layer
leaves, optimizer moments included, in that order (`order.py`: permuted once when the state is
built or restored, un-permuted for checkpoints, HF export and the gradients tests read). Measured
on the production step of config-built runs, tiny Llama, 8 layers, p = 2, bytes per device per
step over `pipeline` (tests/parallel/pipeline/test_pipeline_layer_order.py): interleaved 1F1B at m = 4, the 722,944
of layer and gradient collective-permutes gone, the 1,501,276 of activations, gradients and vocab
reductions unchanged; zb_v at m = 2, 722,944 → 0, 3,002,204 unchanged. The order is a property of
(split, p, v, stage map) — a checkpoint written in [L] order maps onto any of them.

Chosen over storing the staged layout in the train state (mesh-dependent shapes: checkpoints,
HF export and the optimizer would all need converting) and over a storage split that follows
the stage split (jax shards only evenly). Proven equal to one device by `tests/parallel/pipeline/test_pipeline.py`.
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
        """The staged view is the storage block itself, in order (a free reshape): every rank's
        stages are its block's layers, e.g. an equal split with v = 1 on the modular map, or any
        equal split on storage in the schedule's order (`storage_order`)."""
        block = sum(self.split) // self.num_ranks
        return (
            self.sharded and not self.shifts and self.virtual_stages * self.max_layers == block
            and bool((self.tables["pool"] == np.arange(block)).all())
        )


def storage_order(split, p: int, v: int, stages: StageMap | None = None) -> tuple:
    """The layer ids in the order that puts every rank's stages in its own storage block: rank 0's
    stages (local index 0, 1, ...), then rank 1's, ... With an equal split every rank's layers
    fill exactly its block, so the staged view needs no exchange; otherwise only the layers
    beyond a block's size move."""
    stages = modular_stages(p, v) if stages is None else stages
    starts = np.cumsum((0,) + tuple(split))
    index = {tuple(place): s for s, place in enumerate(stages)}
    return tuple(int(i) for r in range(p) for u in range(v)
                 for i in range(starts[index[(r, u)]], starts[index[(r, u)] + 1]))


def stage_layout(split, p: int, v: int, stages: StageMap | None = None, stored: tuple | None = None) -> StageLayout:
    """The index tables for `split` (layers per global stage) on p ranks × v, each stage on the
    (rank, local virtual stage) `stages` gives it (default `modular_stages`). `stored`: the layer
    id at each storage position (None: layer i at position i; `storage_order` for storage laid
    out for this map)."""
    stages = modular_stages(p, v) if stages is None else stages
    layers = sum(split)
    sharded = layers % p == 0
    block = layers // p if sharded else layers
    position = list(range(layers))
    for at, layer in enumerate(stored or ()):
        position[layer] = at
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
        return position[layer] // block if sharded else None

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
            send[q, : len(sent)] = [position[layer] - q * block for layer in sent]
        tables[f"send{d}"] = send
    offsets, at = {}, block
    for d, k in shifts:
        offsets[d] = at
        at += k
    for r, pairs in needs.items():
        for slot, layer in pairs:
            q = owner(layer)
            if q is None:
                pool[r, slot] = position[layer]
            elif q == r:
                pool[r, slot] = position[layer] - r * block
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
            return a.reshape(v, lmax, *a.shape[1:])
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
