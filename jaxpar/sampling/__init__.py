"""Inference: sampling with a KV cache from any jaxpar model, on one device or on a mesh.

`generate(model_config, params, prompts, ...)` (also `jaxpar.generate`) returns token ids;
`Sampler` (`engine`) is the reusable form (params placed once, programs compiled once per shape
bucket); `filters` chooses the next token (greedy, temperature, top-k, top-p); `load` brings
params from a run's checkpoint, a converted checkpoint or a transformers directory onto the
sampling mesh. `scripts/sample.py` is the command line. The decode path reuses the training
modules (`Decoder.extend` -> `DecoderBlock.cached` -> `Attention.cached`).
"""

from jaxpar.sampling.engine import Result, SampleError, Sampler, generate, mesh_problems
from jaxpar.sampling.filters import SamplingParams

__all__ = ["Result", "SampleError", "Sampler", "SamplingParams", "generate", "mesh_problems"]
