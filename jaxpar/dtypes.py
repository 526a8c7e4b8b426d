"""The compute / parameter dtype names a config may use, defined once: their jax dtypes and their
bytes per element. (HLO's own type names, `f32`, `bf16`..., are the HLO reader's business:
`jaxpar.analysis.program.hlo.DTYPE_BYTES`.)"""

import jax.numpy as jnp

# `train.param_dtype` / `train.compute_dtype` names and what they mean.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_BYTES = {name: jnp.dtype(dtype).itemsize for name, dtype in DTYPES.items()}
