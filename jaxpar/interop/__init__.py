"""Converters between jaxpar params and other libraries' checkpoints.

`from jaxpar.interop import hf` for transformers (Hugging Face) checkpoints: `hf.load` / `hf.save`.
`hf_core` holds what every family shares; `hf_llama` and `hf_mixtral` are the families' adapters,
which their records in `jaxpar.models.families` name.
"""
