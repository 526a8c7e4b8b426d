"""Reading compiled programs: what XLA made of the train step, independent of the cost model.

- `hlo`, `hlo_groups`: the HLO text reader (collectives, replica groups, loops, branches, mesh axes).
- `hlo_flops`: matmul FLOPs of compiled HLO with loop trip counts applied.
- `wire`: the byte convention collectives are counted in (also the cost model's).
- `compiled`: AOT-compile jaxpar's train step on abstract inputs; memory, FLOPs, collectives.
- `profile`: a `jax.profiler` trace of the step read back per named scope, joined to the HLO.
"""
