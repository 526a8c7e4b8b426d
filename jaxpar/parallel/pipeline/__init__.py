"""Pipeline parallelism over `pipeline`: a schedule is a static table that one engine executes.

- `table`: what a schedule table is (cells of F/B/W actions, its stage -> rank map, the hops that
  map uses), its lockstep cost model, printer and parser.
- `schedules`: the schedules as records (`ScheduleKind`: gpipe, 1f1b, interleaved_1f1b, zb_h1,
  zb_v, dualpipev), their builders, constraints and textbook bubbles.
- `vshape`: the V stage map (rank r holds stages r and 2p - 1 - r) and the zb_v and dualpipev builders.
- `programs`: tables laid out from per-rank programs (`from_programs`).
- `checks`: what makes a table valid, and its peak stash per rank.
- `balance`: stage splits (explicit or `auto`) from an analytic per-stage cost, modelled step time.
- `options`: `PipelineOptions` from the config, and the config checks.
- `slots`: turns a table into the engine's per-step branch indices and buffer slots.
- `layout`: the `[L, ...]` layer stacks viewed as each rank's (possibly uneven) stages.
- `stage`: one stage's forward and recomputing backward (and what the end stages run besides layers).
- `vocab`: the embedding and LM head + loss split by vocab over the pipeline ranks.
- `router`: MoE router statistics through the pipeline (per-microbatch aux losses).
- `shard`: the engine's `shard_map`: microbatches, tables and every input's and output's spec.
- `engine`: the per-rank `lax.scan` that runs a table.

Nothing is imported here: `table`, `schedules` and `checks` stay usable without jax.
"""
