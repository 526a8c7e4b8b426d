"""Dynamic loss scaling for fp16 training, and the count of skipped (non-finite) steps in any dtype.

The scale and the finite check are values of the global (SPMD) computation, so every device sees
the same verdict: the finite check reduces over all gradient shards before anyone decides.
A non-finite step keeps params and optimizer state, halves the scale and is counted; after
`period` finite steps in a row the scale doubles.
"""

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LossScale:
    scale: jax.Array  # float32 scalar; 1.0 and never changed unless dynamic
    good_steps: jax.Array  # int32: finite steps since the last change
    skipped_steps: jax.Array  # int32: total non-finite steps skipped
    dynamic: bool = struct.field(pytree_node=False, default=False)
    period: int = struct.field(pytree_node=False, default=2000)

    @classmethod
    def create(cls, dynamic: bool, initial_scale: float, period: int) -> "LossScale":
        return cls(
            scale=jnp.asarray(initial_scale if dynamic else 1.0, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            dynamic=dynamic,
            period=period,
        )

    def update(self, finite) -> "LossScale":
        if not self.dynamic:  # the scale stays 1; non-finite steps are still skipped and counted
            return self.replace(skipped_steps=self.skipped_steps + (~finite).astype(jnp.int32))
        grow = finite & (self.good_steps + 1 >= self.period)
        scale = jnp.where(finite, jnp.where(grow, self.scale * 2, self.scale), jnp.maximum(self.scale / 2, 1.0))
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale, good_steps=good, skipped_steps=self.skipped_steps + (~finite).astype(jnp.int32))


def all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves))
