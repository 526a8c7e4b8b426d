"""How to run a forward pass: sharding rules, the plan (with its remat policy and attention
kernel, decided once: `jaxpar.parallel.plan`), and the compute dtype."""

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
