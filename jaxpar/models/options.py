"""How to run a forward pass: sharding rules, the plan (with its remat policy and attention
kernel, decided once: `jaxpar.parallel.plan`), the compute dtype, and whether the training loss
runs the model's multi-token prediction modules."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxpar.parallel.plan import SINGLE_DEVICE, ParallelPlan
from jaxpar.sharding import Rules


@dataclass(frozen=True)
class RunOptions:
    rules: Rules | None = None  # None: no mesh (one device)
    plan: ParallelPlan = SINGLE_DEVICE
    compute_dtype: jnp.dtype = jnp.float32
    # > 0: the training loss (`jaxpar.train.loss`) runs the model's multi-token prediction modules
    # (if it has any) and adds this times their mean loss (`train.mtp_loss_weight`); 0: off, as at inference.
    mtp_loss_weight: float = 0.0
