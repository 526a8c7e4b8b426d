"""One module per parallelism, and the plan that decides them once per run.

- `plan`: `ParallelPlan`, every parallel decision for a config and mesh, built once at setup.
- `data`: batch axes, microbatches, gradient accumulation strategies.
- `zero`: ZeRO-1 / ZeRO-3 (FSDP) over `data`.
- `tensor`: Megatron tensor parallelism, sequence parallelism, KV-head replication, vocab-parallel loss.
- `expert`: expert parallelism (MoE all-to-all dispatch).
- `pipeline/`: schedules as tables, their checks, slot planning, the stage and the engine.

The rules that map logical names to mesh axes stay in `jaxpar.sharding`: these modules own
behaviour, not rules. Nothing is imported here, so `import jaxpar.parallel.pipeline.schedules`
stays free of jax.
"""
