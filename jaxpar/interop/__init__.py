"""Converters between jaxpar params and other libraries' checkpoints.

`from jaxpar.interop import hf` for transformers (Hugging Face) checkpoints: `hf.load` / `hf.save`;
`sharded` reads them straight onto a mesh. `hf_core` holds the files and what every family
shares; each family's adapter lives in its folder (`jaxpar/models/<family>/hf.py`) and its record
(`jaxpar.models.families`) names it.
"""
