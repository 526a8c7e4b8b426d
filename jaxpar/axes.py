"""The mesh axis names, defined once. Everything else refers to these constants.

Order is `data, pipeline, context, expert, tensor`: the last axis varies fastest over the device
list, so tensor-parallel groups (a collective in every layer) are physical neighbours and
data-parallel replicas (one gradient reduction per step) are farthest apart.
"""

DATA = "data"
PIPELINE = "pipeline"
CONTEXT = "context"
EXPERT = "expert"
TENSOR = "tensor"

MESH_AXES = (DATA, PIPELINE, CONTEXT, EXPERT, TENSOR)
