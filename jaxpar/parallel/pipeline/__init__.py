"""Pipeline parallelism over `pipeline`: a schedule is a static table that one engine executes.

- `schedules`: the tables (gpipe, 1f1b, interleaved_1f1b, zb_h1), their printer and parser.
- `checks`: what makes a table valid, and its peak stash per rank.
- `options`: `PipelineOptions` from the config, and the config checks.
- `slots`: turns a table into the engine's per-step branch indices and buffer slots.
- `layout`: the `[L, ...]` layer stacks viewed as `[p, v, Lc, ...]` stages.
- `stage`: one stage's forward and recomputing backward.
- `engine`: the `shard_map` + `lax.scan` that runs a table.

Nothing is imported here: `schedules` and `checks` stay usable without jax.
"""
