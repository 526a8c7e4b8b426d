"""How to run a forward pass: sharding rules, the plan (with its remat policy and attention
kernel, decided once: `jaxpar.parallel.plan`), the compute dtype, and whether the training loss
runs the model's multi-token prediction modules."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.fp8 import Fp8
from jaxpar.kernels.fp8 import Scaling
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
    fp8: Fp8 | None = None  # `train.fp8`: None, every matmul in compute_dtype
    # The train step's LoRA dropout key (`jaxpar.models.lora_dropout.step_key`; None: no adapter
    # dropout, as in evaluation and sampling). A traced value: set inside the step only.
    lora_dropout_key: jax.Array | None = None

    def fp8_at(self, name: str) -> Scaling | None:
        """How the matmul `name` (`jaxpar.fp8.FP8_MATMULS`) scales its FP8 operands; None: not FP8."""
        return None if self.fp8 is None else self.fp8.at(name)
