"""Is a checkpoint's saved config compatible with the config of the run that wants to resume from it?

The model and data sections must match exactly (same architecture, same parameter shapes and
meaning; the same corpus, so the saved data position means the same thing). How the run is laid out
(mesh, parallel), how long it runs (train.steps), how it logs, reacts to non-finite steps and
checkpoints may change freely: restoring onto a different mesh is supported. Other differences
(batch size, seed, learning-rate schedule, ...) are allowed but reported, since the resumed run then
no longer equals an uninterrupted one. Both configs are compared with their derived defaults
resolved (`jaxpar.config.resolve_derived`): `model.head_dim` None and the value it derives to are the
same model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.config import resolve_derived

# Config sections (written as key prefixes) a resumed run must share with its checkpoint.
MUST_MATCH = ("model.", "data.")
FREE = (
    "mesh", "parallel", "checkpoint", "train.steps", "train.log_every", "train.on_nonfinite", "train.max_skipped_steps",
    "train.max_skipped_fraction", "train.skip_window", "train.init_from_hf",
)
_ABSENT = object()


def as_dict(config: str | Mapping[str, Any]) -> dict:
    """A config given as JSON text or a mapping, as a plain JSON-compatible dict."""
    if isinstance(config, str):
        return json.loads(config)
    return json.loads(json.dumps(dict(config), default=str))


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _under(name: str, sections) -> bool:
    return any(name == s.rstrip(".") or name.startswith(s.rstrip(".") + ".") for s in sections)


def _describe(names, saved, current) -> str:
    missing = "<absent>"
    return ", ".join(f"{n} (saved {saved.get(n, missing)!r}, now {current.get(n, missing)!r})" for n in names)


def compare_configs(saved: str | Mapping, current: str | Mapping, *, checkpoint: str) -> list[str]:
    """Raises CheckpointError (one line) if the model or data sections differ; returns one-line notes
    for the other differing keys that change what an uninterrupted run would have done."""
    saved_flat, current_flat = _flatten(resolve_derived(as_dict(saved))), _flatten(resolve_derived(as_dict(current)))
    differing = sorted(
        n for n in saved_flat.keys() | current_flat.keys() if saved_flat.get(n, _ABSENT) != current_flat.get(n, _ABSENT)
    )
    fixed = [n for n in differing if _under(n, MUST_MATCH)]
    if fixed:
        sections = " and ".join(s.rstrip(".") for s in MUST_MATCH if any(_under(n, (s,)) for n in fixed))
        raise CheckpointError(
            f"checkpoint {checkpoint} was saved with a different {sections}: "
            f"{_describe(fixed, saved_flat, current_flat)}; resuming needs the same {' and '.join('config.' + s.rstrip('.') for s in MUST_MATCH)}"
        )
    noted = [n for n in differing if not _under(n, FREE)]
    if not noted:
        return []
    note = (
        f"config differs from checkpoint {checkpoint} in {_describe(noted, saved_flat, current_flat)}: "
        f"the resumed run will not equal an uninterrupted one"
    )
    return [note]
