"""Looking into a checkpoint directory without opening a manager (no collectives, no writes): which
steps are complete and what config a step was saved with. Used by the preflight of a run, which must
decide "resume or refuse" before it writes anything."""

from __future__ import annotations

import json

import orbax.checkpoint as ocp
from etils import epath

from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.checkpoint.manager import CONFIG, DATA
from jaxpar.config import upgrade

# What Orbax's JsonCheckpointHandler names the file of a JSON item.
JSON_ITEM_FILE = "metadata"
# The data-state key scripts/convert.py sets on a checkpoint it made from a transformers checkpoint.
CONVERTED_FROM = "converted_from"


def finished_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints in `directory`, oldest first ([] if it does not exist)."""
    path = epath.Path(directory)
    if not path.exists():
        return []
    return sorted(ocp.path.step.checkpoint_steps(path))


def incomplete_saves(directory: str) -> list[str]:
    """Paths of interrupted saves (Orbax's `*.orbax-checkpoint-tmp*` directories)."""
    path = epath.Path(directory)
    if not path.exists():
        return []
    return sorted(str(path / name) for name in ocp.path.step.tmp_checkpoints(path))


def saved_config(directory: str, step: int) -> dict:
    """The config step `step` was saved with, in today's layout (`jaxpar.config.upgrade`: keys that
    moved since are where they are now); CheckpointError naming the file if unreadable."""
    return upgrade(_json_item(directory, step, CONFIG))


def saved_data_state(directory: str, step: int) -> dict:
    """The data iterator's state step `step` was saved with; CheckpointError if unreadable."""
    return _json_item(directory, step, DATA)


def converted_from(directory: str, steps) -> tuple[int, str] | None:
    """(step, transformers checkpoint) of the first of `steps` that scripts/convert.py wrote, if any."""
    for step in steps:
        try:
            origin = saved_data_state(directory, step).get(CONVERTED_FROM)
        except CheckpointError:
            continue
        if origin:
            return step, str(origin)
    return None


def _json_item(directory: str, step: int, item: str) -> dict:
    file = epath.Path(directory) / str(step) / item / JSON_ITEM_FILE
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {item} {file} is unreadable ({type(e).__name__}: {e})") from None
