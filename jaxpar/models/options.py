"""How to run a forward pass: sharding rules, the parallel plan, dtype, attention kernel, remat."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.parallel.plan import SINGLE_DEVICE, ParallelPlan
from jaxpar.sharding import Rules

# xla: jax.nn.dot_product_attention's XLA path; cudnn: its cuDNN path; jaxpar_xla:
# `jaxpar.kernels.attention` (plain XLA, hand-written backward).
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "jaxpar_xla")


@dataclass(frozen=True)
class RunOptions:
    rules: Rules | None = None  # None: no mesh (one device)
    plan: ParallelPlan = SINGLE_DEVICE
    compute_dtype: jnp.dtype = jnp.float32
    attention_impl: str = "xla"  # resolved: "xla", "cudnn" or "jaxpar_xla"
    remat: str = "none"  # a key of `jaxpar.models.llama.REMAT_POLICIES` (resolved, never "auto")


def resolve_attention_impl(name: str, compute_dtype) -> str:
    """`parallel.attention_impl`: "auto" is cuDNN on GPU for 16-bit compute, jaxpar's own XLA
    kernel on CPU (bench config, one device, fp32: attention forward + backward 1.8× faster than
    jax's XLA path), jax's XLA path otherwise."""
    if name != "auto":
        return name
    backend = jax.default_backend()
    if backend == "gpu" and compute_dtype in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "jaxpar_xla" if backend == "cpu" else "xla"


# `parallel.remat="auto"` per backend: the fastest policy measured there. XLA:CPU, fp32, 2 cores:
# the bench config on one device, none 940 / full 1093 / save_dots 1078 tokens/s (issue 11's
# machine); MaxText's tiny Llama on 8 emulated devices, none 5.3-5.8k / full 7.4-7.9k. Saving every
# layer's residuals through the layer scan costs XLA:CPU more than recomputing them. (On a slower
# 2-core host on 2026-11-29 the one-device bench tied: none 782, full 764, save_dots 779.)
# Elsewhere no recompute, the fastest whenever the activations fit (not measured here: no GPU was
# lent; set parallel.remat to "full" or "save_dots" when they do not fit).
AUTO_REMAT = {"cpu": "full"}


def resolve_remat(name: str) -> str:
    return AUTO_REMAT.get(jax.default_backend(), "none") if name == "auto" else name
