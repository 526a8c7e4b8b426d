"""How to run a forward pass: sharding rules, the parallel plan, dtype, attention kernel, remat."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.parallel.plan import SINGLE_DEVICE, ParallelPlan
from jaxpar.sharding import Rules

ATTENTION_IMPLS = ("auto", "xla", "cudnn")


@dataclass(frozen=True)
class RunOptions:
    rules: Rules | None = None  # None: no mesh (one device)
    plan: ParallelPlan = SINGLE_DEVICE
    compute_dtype: jnp.dtype = jnp.float32
    attention_impl: str = "xla"  # resolved: "xla" or "cudnn"
    remat: str = "none"  # a key of `jaxpar.models.llama.REMAT_POLICIES`


def resolve_attention_impl(name: str, compute_dtype) -> str:
    """`parallel.attention_impl`: "auto" is cuDNN on GPU for 16-bit compute, XLA otherwise."""
    if name != "auto":
        return name
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and compute_dtype in (jnp.bfloat16, jnp.float16) else "xla"
