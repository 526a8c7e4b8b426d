"""Cost analysis for jaxpar layouts: an analytic model, and what XLA actually compiles to check it.

- `hlo`, `hlo_groups`: the HLO reader (collectives, replica groups, loops, branches, mesh axes).
- `hlo_flops`: matmul FLOPs of compiled HLO with loop trip counts applied.
- `compiled`: AOT-compile jaxpar's train step on abstract inputs; memory, FLOPs, collectives.
- `hardware`: accelerator profiles (A100, H100, H200, TPU v5p) and link assignment per mesh axis.
- `layout`: what is priced: the `ParallelPlan` the run would execute (`make_plan`) and the
  family's `ModelFacts`; nothing here re-derives a decision the plan makes.
- `memory`, `comm` (with `comm_context`, `comm_zero`), `cost_model`: per-device memory, collectives
  per axis, FLOPs by part, step time; `efficiency`: the achieved rates the step time uses (matmuls by
  shape, attention at its kernel's, communication hidden behind compute).
- `published`: published GPU training runs beside the model's prediction (docs/experiments.md).
- `fit_advice`: the planner's way out when the training loop's fit check (`jaxpar.train.fit`) stops a
  run; `zero_memory`: what ZeRO over data x context saves, compiled and planned.
- `fidelity`: the model next to the compiled program.
- `candidates`: the layouts of a config on N devices (mesh x ZeRO x remat x SP x microbatches),
  screened by preflight.
- `search`, `plan_text`, `planner`: rank the layouts that fit, explain the choice;
  `planner.best_plan` is what `scripts/train.py --plan` calls, `planner.report` what
  `scripts/plan.py` prints.
- `sweep`, `plots`: compile every layout and set the model beside it (`scripts/sweep.py`).
- `profile`: a `jax.profiler` trace of the train step read back per named scope, joined to the
  step's HLO through `hlo` (`scripts/profile_report.py`).

Nothing is imported here, so `import jaxpar.analysis.hlo` stays free of jaxpar's model code.
"""
