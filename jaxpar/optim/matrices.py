"""The per-matrix view of stacked parameters, for optimizers that are not elementwise.

Layers are stored stacked (`[L, ...]`, logical name `layers`; multi-token prediction modules
`depth`) and MoE experts too (`experts`), so one parameter leaf holds many matrices. Adafactor's RMS
clipping and parameter scale and Muon's orthogonalisation are defined per matrix: these helpers
treat the leading `layers` / `depth` / `experts` dims as batch dims and never mix matrices across
them. Which dims form a Muon matrix follows the logical names: the dims after the batch dims,
split into input (`embed` first: q, k, v, gate, up) and output (`embed` last: o, down; else the
first dim: MLA's up-projections from their `latent`). Embeddings and the LM head (`vocab`), norm
scales and the MoE router (an unnamed expert-logit dim) are not Muon matrices.

Muon needs each whole matrix: where tensor parallelism or ZeRO shards a matrix dim, the momentum
is gathered to `whole_matrix_spec` (matrix dims replicated, batch dims as they were — pipeline
and expert shards keep their own layers and experts) before Newton–Schulz, and the result is cut
back to the optimizer-state layout. `gathered_bytes` says what that all-gather moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Logical names of dims that index matrices rather than lie inside one.
BATCH_NAMES = ("layers", "experts", "depth")
# Every logical name a parameter dim carries (tests/optim/test_optimizers.py checks it against the models).
PARAM_NAMES = ("vocab", "embed", "norm", "heads", "kv_heads", "head_dim", "mlp", "layers", "experts", "latent", "depth")


def batch_dims(names) -> int:
    """How many leading dims are batch dims (stacked layers, experts)."""
    count = 0
    while count < len(names) and names[count] in BATCH_NAMES:
        count += 1
    return count


def _rms(x, batch: int):
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=tuple(range(batch, x.ndim)), keepdims=True))


def clip_by_matrix_rms(threshold: float, batch_tree) -> optax.GradientTransformation:
    """optax.clip_by_block_rms with one block per matrix: u / max(1, rms(u) / threshold)."""

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, b: u / jnp.maximum(1.0, _rms(u, b) / threshold), updates, batch_tree), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scale_by_matrix_param_rms(batch_tree, min_scale: float = 1e-3) -> optax.GradientTransformation:
    """optax.scale_by_param_block_rms with one block per matrix: u · max(rms(p), min_scale)."""

    def update(updates, state, params=None):
        return jax.tree.map(lambda u, p, b: u * jnp.maximum(_rms(p, b), min_scale), updates, params, batch_tree), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@dataclass(frozen=True)
class MatrixDims:
    """A Muon matrix inside a leaf: `batch` leading batch dims, then input and output dims."""

    batch: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @property
    def dims(self) -> tuple[int, ...]:
        return self.inputs + self.outputs

    def fans(self, shape) -> tuple[int, int]:
        return math.prod(shape[d] for d in self.inputs), math.prod(shape[d] for d in self.outputs)


def matrix_dims(names) -> MatrixDims | None:
    """The Muon matrix of a parameter with these logical names, or None (AdamW takes it)."""
    batch = batch_dims(names)
    inner = tuple(names[batch:])
    if not {"layers", "depth"} & set(names) or len(inner) < 2 or any(n is None or n in ("vocab", "norm") for n in inner):
        return None
    dims = tuple(range(batch, len(names)))
    split = 1 if inner[0] == "embed" or inner[-1] != "embed" else len(inner) - 1
    return MatrixDims(batch, dims[:split], dims[split:])


def _entries(spec: P, ndim: int) -> list:
    return list(spec) + [None] * (ndim - len(spec))


def whole_matrix_spec(spec: P, matrix: MatrixDims, ndim: int) -> P:
    """`spec` with the matrix dims unsharded: each device holds whole matrices of its batch shard."""
    return P(*[None if d in matrix.dims else e for d, e in enumerate(_entries(spec, ndim))])


def whole_matrix_sharding(sharding: NamedSharding, matrix: MatrixDims, ndim: int) -> NamedSharding:
    return NamedSharding(sharding.mesh, whole_matrix_spec(sharding.spec, matrix, ndim))


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def gathered_bytes(shape, names, spec: P, mesh_sizes: dict, itemsize: int = 4) -> int:
    """Bytes one device receives per step gathering this leaf's Muon momentum from the optimizer-state
    layout `spec` to whole matrices: its whole-matrix slice minus the shard it already holds (an
    all-gather over the axes sharding the matrix dims). fp32: Muon orthogonalises the momentum
    mixed with the fp32 gradient. 0 for a leaf that is not a Muon matrix or not sharded there."""
    matrix = matrix_dims(names)
    if matrix is None:
        return 0
    entries = _entries(spec, len(shape))
    split = lambda d: math.prod(mesh_sizes[a] for a in _axes(entries[d]))  # noqa: E731
    whole = math.prod(shape[d] // split(d) if d not in matrix.dims else shape[d] for d in range(len(shape)))
    group = math.prod(split(d) for d in matrix.dims)
    return whole * itemsize * (group - 1) // group


def newton_schulz_flops(shape, names, spec: P, mesh_sizes: dict, ns_steps: int) -> int:
    """FLOPs one device spends per step orthogonalising this leaf's whole matrices (every device
    of the group runs the same iteration on the same gathered matrices): per matrix and
    iteration, X·Xᵀ and B·X (2·m²·n each) and A·A (2·m³), m ≤ n the matrix's two sides."""
    matrix = matrix_dims(names)
    if matrix is None:
        return 0
    entries = _entries(spec, len(shape))
    local = math.prod(shape[d] // math.prod(mesh_sizes[a] for a in _axes(entries[d])) for d in range(matrix.batch))
    m, n = sorted(matrix.fans(shape))
    return local * ns_steps * (4 * m * m * n + 2 * m**3)
