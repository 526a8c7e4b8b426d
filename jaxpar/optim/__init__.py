"""Optimizers and learning-rate schedules: what `train.optimizer`, `train.lr_schedule` and the
weight-decay mask build, and what their state costs and where it lives.

A top-level package (not under `jaxpar.train`) because three layers read the records: the train
step builds from them, checkpoints compare their hyperparameters on resume (`jaxpar.checkpoint`),
and the cost model prices their state and Muon's gathers (`jaxpar.analysis`); none of those should
import the training program. It imports only `jaxpar.sharding` and `jaxpar.ranges`.

- `optimizers`: one `Optimizer` record per optimizer, `OPTIMIZERS`, `optimizer(name)`.
- `schedules`: one `Schedule` record per learning-rate schedule, `SCHEDULES`, `schedule(name)`.
- `hyperparameters`: the keys a record declares for its own section `train.<name>`; `SECTIONS`
  gathers every record's (what `jaxpar.config` builds the sections from).
- `matrices`, `muon`: the per-matrix view of stacked layers (Adafactor's RMS blocks, Muon's
  orthogonalisation and its whole-matrix gather).
- `state`: every state leaf's sharding (ZeRO) and bytes, derived from the record.
"""

from __future__ import annotations

import jax
import optax

from jaxpar.optim.hyperparameters import Hyperparameter, Range, section_problems
from jaxpar.optim.matrices import PARAM_NAMES
from jaxpar.optim.optimizers import OPTIMIZER_NAMES, OPTIMIZERS, Optimizer, StateLeaf, optimizer
from jaxpar.optim.schedules import DECAY_SHAPES, SCHEDULE_NAMES, SCHEDULES, learning_rate_schedule, schedule
from jaxpar.optim.state import state_axes, state_shardings, tree_state_bytes
from jaxpar.sharding import is_logical_names

DEFAULT_OPTIMIZER = "adamw"  # also what a checkpoint saved before `train.optimizer` existed used


def _sections() -> dict[str, tuple[Hyperparameter, ...]]:
    sections = {}
    for record in OPTIMIZERS + SCHEDULES:
        if record.hyperparameters:
            if record.name in sections:
                raise AssertionError(f"two records own the section train.{record.name}")
            sections[record.name] = record.hyperparameters
    return sections


# Every record's section `train.<name>` and its keys: optimizers, then learning-rate schedules.
SECTIONS: dict[str, tuple[Hyperparameter, ...]] = _sections()


def hyperparameter_problems(train) -> list[str]:
    """The range problems of every record's section, selected or not (a bad value is a mistake
    either way; an unused one is otherwise fine), one line each naming the full key."""
    return [line for name, keys in SECTIONS.items() for line in section_problems(name, keys, train[name])]


def excluded_from_decay(train) -> tuple[str, ...]:
    """`train.weight_decay_exclude`: logical names, comma-separated; a parameter with any of them is not decayed."""
    return tuple(n.strip() for n in str(train.weight_decay_exclude).split(",") if n.strip())


def decay_mask(logical_axes, excluded=("norm",)):
    """True where weight decay applies: parameters carrying none of the `excluded` logical names.
    The default leaves norm scales alone and decays everything else, embeddings and the LM head
    (tied or not) included; `norm,vocab` also spares the embedding and head."""
    return jax.tree.map(lambda names: not any(n in names for n in excluded), logical_axes, is_leaf=is_logical_names)


def make_optimizer(train, logical_axes, state_layouts=None):
    """(optax transformation, learning-rate schedule) of `config.train`: global-norm clipping, then
    the optimizer. `state_layouts`: the parameter-shaped optimizer-state shardings on the run's mesh
    (Muon gathers whole matrices from them); None off a mesh."""
    schedule_fn = learning_rate_schedule(train)
    mask = decay_mask(logical_axes, excluded_from_decay(train))
    inner = optimizer(train.optimizer).build(train, schedule_fn, logical_axes, mask, state_layouts)
    return optax.chain(optax.clip_by_global_norm(train.max_grad_norm), inner), schedule_fn


def resume_keys(optimizer_name: str) -> tuple[str, ...]:
    """The `train.` keys a resumed run must share with its checkpoint: the optimizer and the keys
    of every section it reads (what its saved state means), e.g. `lion.b1`. The learning rate,
    schedule, weight decay and clipping may change."""
    record = optimizer(optimizer_name)
    return ("optimizer",) + tuple(f"{name}.{h.name}" for name in record.sections for h in SECTIONS.get(name, ()))


__all__ = [
    "DECAY_SHAPES", "DEFAULT_OPTIMIZER", "Hyperparameter", "OPTIMIZERS", "OPTIMIZER_NAMES", "Optimizer", "PARAM_NAMES",
    "Range", "SCHEDULES", "SCHEDULE_NAMES", "SECTIONS", "StateLeaf", "decay_mask", "excluded_from_decay",
    "hyperparameter_problems", "learning_rate_schedule", "make_optimizer", "optimizer", "resume_keys", "schedule",
    "state_axes", "state_shardings", "tree_state_bytes",
]
