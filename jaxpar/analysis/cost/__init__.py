"""The analytic cost model of the plan that runs.

- `layout`: what is priced: the `ParallelPlan` the run would execute (`make_plan`) and the family's
  `ModelFacts`; nothing here re-derives a decision the plan makes. `leaves`: the model's parameter
  leaves by logical names.
- `hardware`: accelerator profiles (A100, H100, H200, TPU v5p) and the link each mesh axis uses.
- `memory`, `optimizer_terms`: per-device bytes by part (parameters, optimizer state, activations).
- `planned`, `comm` (with `comm_context`, `comm_zero`): the collectives per step, per mesh axis.
- `context_work`, `efficiency`: the achieved rates the step time uses (matmuls by shape, attention
  at its kernel's, communication hidden behind compute).
- `cost_model`: `estimate(layout, hardware)`: memory, FLOPs by part, step time.
"""
