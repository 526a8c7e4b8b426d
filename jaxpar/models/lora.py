"""LoRA: low-rank adapters on named matrices of any family, the rest of the model frozen.

A run with `train.lora.rank` > 0 trains, for each targeted matrix W [*batch, *in, *out] (batch:
its stacked `layers` / `experts` / `depth` dims), A [*batch, *in, r] and B [*batch, r, *out]
(B zero at the start, so the first step's model is the base) and uses W + (alpha / r) · A·B.

Where the adapters live: in the params tree, beside the matrix they adapt (`q` → `q_lora_a`,
`q_lora_b` in the same dict), so every mechanism that handles params handles them with no
plumbing of its own: they get logical names (the matrix's own, with `lora_rank` for the inner
dim, which the rules table maps to no mesh axis), hence the same shardings (ZeRO, tensor,
expert), the pipeline stages them with their layers (they are inside the `layers` subtree), the
storage order permutes them and checkpoints hold them. The model config carries the adapter
settings (`adapted`), so `jaxpar.models.param_shapes / logical_axes / init_params / merge` build
and read the adapted tree; `merge` folds each adapter into its matrix (`fold`) before the module
sees it, with the base under `stop_gradient`: the base gets no gradient (zeros, which XLA does
not compute), and the train step masks it out of the optimizer (no state) and keeps it bitwise.

The same weights without the adapters (e.g. a DPO reference model): `base_of(params)` with the
model config `base_config(cfg)` — no copy, the base leaves are shared.

Folded, not a side path x·A·B: one code path for every family's projections (attention,
MLP, experts, MLA's latents) without touching them, at the cost of a per-step delta the size of
the targeted matrices and of their gradient w.r.t. the folded weight (not stored between steps).
Adapter dropout needs the side path: with `train.lora.dropout` > 0 training runs the adapters of
attention and MLP matrices beside them (`jaxpar.models.lora_dropout`); evaluation still folds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict, FrozenConfigDict

RANK = "lora_rank"  # the adapters' inner dim: replicated (`jaxpar.sharding.rules_table`)
BATCH = ("layers", "experts", "depth")  # stacked dims: each slice has its own adapter
SUFFIXES = ("_lora_a", "_lora_b")
HEAD_INPUTS = "heads"  # a matrix whose input starts with heads contracts two dims (attention's output)


def settings(model_config):
    """The adapter settings the model config carries (rank, alpha, targets), or None."""
    lora = model_config.get("lora")
    return lora if lora is not None and int(lora.rank) > 0 else None


def targets(section) -> tuple[str, ...]:
    return tuple(t.strip() for t in str(section.targets).split(",") if t.strip())


def adapted(model_config, section):
    """`model_config` carrying `train.lora`'s adapter settings (itself when rank is 0)."""
    if int(section.rank) <= 0:
        return model_config
    cfg = ConfigDict(model_config.to_dict())
    cfg.lora = ConfigDict(dict(rank=int(section.rank), alpha=float(section.alpha), targets=",".join(targets(section))))
    if section.get("dropout", 0):  # only then: a run without dropout keeps the model config it had
        cfg.lora.dropout = float(section.dropout)
    return FrozenConfigDict(cfg) if isinstance(model_config, FrozenConfigDict) else cfg


def base_config(model_config):
    """The model config without adapters."""
    if model_config.get("lora") is None:
        return model_config
    cfg = ConfigDict(model_config.to_dict())
    del cfg["lora"]
    return FrozenConfigDict(cfg) if isinstance(model_config, FrozenConfigDict) else cfg


def scale(lora) -> float:
    return float(lora.alpha) / int(lora.rank)


def _flat(tree, is_leaf=None) -> dict:
    return {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def split_dims(names) -> tuple[int, int]:
    """(stacked dims, input dims) of a matrix with logical `names`; the rest are its output."""
    batch = 0
    while batch < len(names) and names[batch] in BATCH:
        batch += 1
    inputs = 2 if batch < len(names) and names[batch] == HEAD_INPUTS else 1
    return batch, inputs


def matrices(base_logical) -> dict:
    """{path: names} of the base params a LoRA can target: every projection (a leaf with an input
    and an output dim beyond its stacked ones), not the embedding, the LM head, norms or biases."""
    found = {}
    for path, names in _flat(base_logical, is_leaf=_is_names).items():
        # A per-head bias [kv_heads, head_dim] has two dims too: biases are named so (q_bias, k_bias, ...).
        if path[0] in ("embed", "lm_head") or path[-1].endswith("bias"):
            continue
        batch, inputs = split_dims(names)
        if len(names) - batch > inputs:
            found[path] = names
    return found


def target_names(base_logical) -> list[str]:
    """The names `train.lora.targets` may use for this family (the matrices' own keys)."""
    return sorted({path[-1] for path in matrices(base_logical)})


def _targeted(base_logical, lora) -> dict:
    wanted = set(targets(lora))
    return {path: names for path, names in matrices(base_logical).items() if path[-1] in wanted}


def _adapter_leaves(base_shapes, base_logical, lora):
    """{adapter path: (shape, names)} for every targeted matrix."""
    shapes, r = _flat(base_shapes), int(lora.rank)
    out = {}
    for path, names in _targeted(base_logical, lora).items():
        shape = shapes[path].shape
        batch, inputs = split_dims(names)
        cut = batch + inputs
        a, b = (path[:-1] + (path[-1] + s,) for s in SUFFIXES)
        out[a] = (shape[:cut] + (r,), names[:cut] + (RANK,))
        out[b] = (shape[:batch] + (r,) + shape[cut:], names[:batch] + (RANK,) + names[cut:])
    return out


def _insert(tree: dict, path: tuple, value) -> dict:
    if len(path) == 1:
        if path[0] in tree:
            raise ValueError(f"LoRA adapter key {path[0]!r} collides with a model parameter")
        return {**tree, path[0]: value}
    return {**tree, path[0]: _insert(tree[path[0]], path[1:], value)}


def with_shapes(base_shapes, base_logical, lora, dtype=None):
    """The params' ShapeDtypeStructs with the adapters added (in the base matrix's dtype)."""
    flat = _flat(base_shapes)
    tree = base_shapes
    for path, (shape, _) in _adapter_leaves(base_shapes, base_logical, lora).items():
        like = flat[path[:-1] + (path[-1][: -len(SUFFIXES[0])],)]
        tree = _insert(tree, path, jax.ShapeDtypeStruct(shape, dtype or like.dtype))
    return tree


def with_logical(base_shapes, base_logical, lora):
    tree = base_logical
    for path, (_, names) in _adapter_leaves(base_shapes, base_logical, lora).items():
        tree = _insert(tree, path, names)
    return tree


def with_init(base_params, base_logical, lora, seed: int):
    """`base_params` with fresh adapters: A ~ U(±1 / sqrt(fan in)) (PEFT's default, Kaiming-uniform
    with a = sqrt(5)), B zero."""
    key = jax.random.fold_in(jax.random.key(seed), 0x10AA)
    tree = base_params
    leaves = _adapter_leaves(base_params, base_logical, lora)
    for i, (path, (shape, names)) in enumerate(sorted(leaves.items())):
        dtype = _flat(base_params)[path[:-1] + (path[-1][: -len(SUFFIXES[0])],)].dtype
        if path[-1].endswith(SUFFIXES[1]):
            value = jnp.zeros(shape, dtype)
        else:
            batch, inputs = split_dims(names[:-1] + ("x",))
            fan_in = math.prod(shape[batch : batch + inputs])
            bound = 1.0 / math.sqrt(fan_in)
            value = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound, bound).astype(dtype)
        tree = _insert(tree, path, value)
    return tree


def is_adapter(path) -> bool:
    last = path[-1]
    last = getattr(last, "key", last)
    return isinstance(last, str) and last.endswith(SUFFIXES)


def adapter_mask(tree, is_leaf=None):
    """`tree` (params, or their logical names) with True at the adapter leaves."""
    return jax.tree_util.tree_map_with_path(lambda p, _: is_adapter(p), tree, is_leaf=is_leaf)


def _without(tree):
    if not isinstance(tree, dict):
        return tree
    return {k: _without(v) for k, v in tree.items() if not (isinstance(k, str) and k.endswith(SUFFIXES))}


def base_of(tree):
    """The params (or any params-shaped tree) without the adapter leaves: the frozen base model."""
    return _without(tree)


def adapters_of(tree) -> dict:
    """{path: leaf} of the adapter leaves."""
    return {p: x for p, x in _flat(tree).items() if p[-1].endswith(SUFFIXES)}


def adapter_names(logical) -> dict:
    """{path: logical names} of the adapter leaves of a logical-names tree."""
    return {p: x for p, x in _flat(logical, is_leaf=_is_names).items() if p[-1].endswith(SUFFIXES)}


def delta(a, b, names_a):
    """(A·B) reshaped to the adapted matrix: A [*batch, *in, r] · B [*batch, r, *out]."""
    batch, inputs = split_dims(names_a[:-1] + ("x",))
    lead, ins, outs = a.shape[:batch], a.shape[batch:-1], b.shape[batch + 1 :]
    flat = jnp.matmul(a.reshape(*lead, math.prod(ins), a.shape[-1]), b.reshape(*lead, b.shape[batch], math.prod(outs)))
    return flat.reshape(*lead, *ins, *outs)


def fold(params, lora, logical):
    """The base params each targeted matrix W replaced by W + scale · A·B (computed in the dtype
    the params arrive in), the base under stop_gradient: only the adapters get gradients."""
    s = scale(lora)
    names = _flat(logical, is_leaf=_is_names)
    folded = jax.tree.map(jax.lax.stop_gradient, _without(params))
    flat = _flat(params)
    for path in _flat(folded):
        a_path = path[:-1] + (path[-1] + SUFFIXES[0],)
        if a_path not in flat:
            continue
        w = _get(folded, path)
        d = delta(flat[a_path], flat[path[:-1] + (path[-1] + SUFFIXES[1],)], names[a_path])
        folded = _replace(folded, path, w + (s * d).astype(w.dtype))
    return folded


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _replace(tree, path, value):
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], value)}


def merged(params, lora, logical):
    """Plain folded params (no stop_gradient needed, same values): what an export writes."""
    return fold(params, lora, logical)


def problems(section, base_logical) -> list[str]:
    """`train.lora`'s problems, one line each; `base_logical()` gives the base params' logical names
    (called only with LoRA on: building them costs the planner's search a third of its time)."""
    errors = []
    rank, alpha, dropout = section.rank, section.alpha, section.dropout
    if not isinstance(rank, int) or rank < 0:
        errors.append(f"train.lora.rank={rank!r} must be an integer >= 0 (0: no LoRA)")
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        errors.append(f"train.lora.alpha={alpha!r} must be > 0")
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        errors.append(f"train.lora.dropout={dropout!r} must be in [0, 1)")
    if rank == 0 and section.get("init_from_peft"):
        errors.append(f"train.lora.init_from_peft={section.init_from_peft!r} needs train.lora.rank > 0 (the adapter's r)")
    if errors or rank == 0:
        return errors
    known = target_names(base_logical())
    wanted = targets(section)
    unknown = [t for t in wanted if t not in known]
    if unknown or not wanted:
        errors.append(f"train.lora.targets={section.targets!r}: unknown {unknown or 'empty'}; this family's matrices: {','.join(known)}")
    return errors
