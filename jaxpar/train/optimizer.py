"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

import jax
import optax


def learning_rate_schedule(train):
    end_fraction = train.final_learning_rate_fraction
    if train.warmup_steps == 0:
        return optax.cosine_decay_schedule(train.learning_rate, max(train.steps, 1), alpha=end_fraction)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.learning_rate,
        warmup_steps=train.warmup_steps,
        decay_steps=max(train.steps, train.warmup_steps + 1),
        end_value=train.learning_rate * end_fraction,
    )


def decay_mask(logical_axes):
    """Weight decay on matrices only: norm scales (logical name `norm`) are left alone."""
    return jax.tree.map(lambda names: "norm" not in names, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(train, logical_axes):
    schedule = learning_rate_schedule(train)
    tx = optax.chain(
        optax.clip_by_global_norm(train.max_grad_norm),
        optax.adamw(
            schedule,
            b1=train.adam_b1,
            b2=train.adam_b2,
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
            mask=decay_mask(logical_axes),
        ),
    )
    return tx, schedule
