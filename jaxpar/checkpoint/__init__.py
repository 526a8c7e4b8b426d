"""Checkpointing: Orbax checkpoints on shared storage that resume exactly, restore onto any mesh and
survive interrupted saves and damaged files. See `manager.py` for the format and guarantees."""

from jaxpar.checkpoint.config_check import compare_configs
from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.checkpoint.manager import Checkpoints, Restored, abstract_state
from jaxpar.checkpoint.storage import check_shared_storage

__all__ = ["CheckpointError", "Checkpoints", "Restored", "abstract_state", "check_shared_storage", "compare_configs"]
