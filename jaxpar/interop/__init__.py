"""Converters between jaxpar params and other libraries' checkpoints.

`from jaxpar.interop import hf` for transformers (Hugging Face) checkpoints. Submodules are not
imported here, so `import jaxpar` never needs their optional dependencies (safetensors).
"""
