"""Pipeline parallelism over `pipeline`: a schedule is a static table that one engine executes.

- `table`: what a schedule table is (cells of F/B/W actions, its stage -> rank map, the hops that
  map uses), its lockstep cost model, printer and parser.
- `schedules`: the schedules as records (`ScheduleKind`: gpipe, 1f1b, interleaved_1f1b, zb_h1),
  their builders, constraints and textbook bubbles.
- `checks`: what makes a table valid, and its peak stash per rank.
- `balance`: stage splits (explicit or `auto`) from an analytic per-stage cost, modelled step time.
- `options`: `PipelineOptions` from the config, and the config checks.
- `slots`: turns a table into the engine's per-step branch indices and buffer slots.
- `layout`: the `[L, ...]` layer stacks viewed as each rank's (possibly uneven) stages.
- `stage`: one stage's forward and recomputing backward.
- `vocab`: the embedding and LM head + loss split by vocab over the pipeline ranks.
- `router`: MoE router statistics through the pipeline (per-microbatch aux losses).
- `engine`: the `shard_map` + `lax.scan` that runs a table.

Nothing is imported here: `table`, `schedules` and `checks` stay usable without jax.
"""
