"""Every test runs on 8 emulated CPU devices; the flag must be set before jax is imported.

The tests compile many tiny programs and run each for a few steps, so compile time dominates: LLVM
optimisation level 0 halves it and leaves the XLA graph (fusion, sharding, collectives) unchanged.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
