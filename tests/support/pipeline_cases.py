"""The pipeline degeneracy suites' common ground: their model (8 layers) and how a case spells its schedule."""

from tests.support import tiny

STEPS = 3


def pipeline_config(**model):
    return tiny.llama(**{"num_hidden_layers": 8, **model})


def pp(schedule, m, v=1, **parallel):
    return dict(pipeline_schedule=schedule, num_microbatches=m, virtual_stages=v, **parallel)
