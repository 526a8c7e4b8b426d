"""Cost analysis for jaxpar layouts, in four rooms whose imports flow one way
(`tests/test_structure.py` holds them to it):

- `program`: reading what XLA compiled — the HLO reader (collectives, replica groups, loops,
  branches, mesh axes), matmul FLOPs with trip counts, the train step compiled on abstract inputs
  (memory, FLOPs, collectives), a `jax.profiler` trace per named scope, and the byte convention
  collectives are counted in. Imports no other room.
- `cost`: the analytic model of the plan that runs — what is priced (`layout`: the `ParallelPlan`
  `make_plan` builds and the family's facts), hardware profiles, memory, collectives per axis,
  achieved rates, step time (`cost_model.estimate`). Reads `program` only for collective kinds.
- `planner`: the layouts of a config on N devices, ranked by the cost model; the fit check's way
  out; the text that explains a choice. `jaxpar.analysis.planner` itself is what `scripts/train.py
  --plan` and `scripts/plan.py` call.
- `reports`: the model set beside compiled programs and published runs — fidelity, sweeps, plots,
  the markdown sections of docs/experiments.md.

Nothing is imported here, so `import jaxpar.analysis.program.hlo` stays free of jaxpar's model code.
"""
