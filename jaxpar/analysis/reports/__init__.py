"""The cost model set beside what really happens, as tables and plots.

- `fidelity`: the model next to the compiled program, case by case.
- `sweep`, `plots`: compile every layout of a config and set the model beside it (`scripts/sweep.py`).
- `published`: published GPU training runs beside the model's prediction (docs/experiments.md).
- `zero_memory`: what ZeRO over data x context saves, compiled and planned.
- `markdown`: the table writer these share.
"""
