"""Is a checkpoint's saved config compatible with the config of the run that wants to resume from it?

The model and data sections must match exactly (same architecture, same parameter shapes and
meaning; the same corpus, so the saved data position means the same thing), and so must the
optimizer and its own hyperparameters (`jaxpar.optim.resume_keys`: what the saved optimizer state
means); its learning rate, schedule and length, weight decay and clipping may change. How the run is laid out
(mesh, parallel, `train.grad_accum`), how long it runs (train.steps), how it logs, reacts to non-finite steps and
checkpoints may change freely: restoring onto a different mesh is supported. Other differences
(batch size, seed, learning-rate schedule, ...) are allowed but reported, since the resumed run then
no longer equals an uninterrupted one. Both configs are compared with their derived defaults
resolved (`jaxpar.config.resolve_derived`): `model.head_dim` None and the value it derives to are the
same model. A config saved before keys moved is read in today's layout first (`jaxpar.config.upgrade`:
`train.adam_b1` is `train.adamw.b1`), so a checkpoint written before the move resumes; a key added
since it was saved is read as its default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jaxpar.checkpoint.errors import CheckpointError
from jaxpar.config import base_config, resolve_derived, upgrade
from jaxpar.optim import DEFAULT_OPTIMIZER, OPTIMIZER_NAMES, resume_keys
from jaxpar.trackers import KEYS as TRACKER_KEYS

# Config sections (written as key prefixes) a resumed run must share with its checkpoint.
MUST_MATCH = ("model.", "data.")
FREE = (
    "mesh", "parallel", "train.grad_accum", "checkpoint", "train.steps", "train.log_every", "train.on_nonfinite", "train.max_skipped_steps",
    "train.max_skipped_fraction", "train.skip_window", "train.init_from_hf", "train.lora.init_from_peft", "train.skip_fit_check",
    "train.predicted_step_s", "train.loggers", "train.tensorboard", *(f"train.{key.name}" for key in TRACKER_KEYS),
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
    saved_flat, current_flat = (_flatten(resolve_derived(upgrade(as_dict(c)))) for c in (saved, current))
    # A key added after the checkpoint was saved defaults to what runs did before it existed
    # (`train.optimizer`: AdamW; `train.mtp_loss_weight`: no model had such modules then).
    defaults = _flatten(resolve_derived(as_dict(base_config().to_json_best_effort())))
    for name in current_flat.keys() - saved_flat.keys():
        if name in defaults:
            saved_flat[name] = defaults[name]
    differing = sorted(
        n for n in saved_flat.keys() | current_flat.keys() if saved_flat.get(n, _ABSENT) != current_flat.get(n, _ABSENT)
    )
    fixed = [n for n in differing if _under(n, MUST_MATCH)]
    if fixed:
        sections = " and ".join(s.rstrip(".") for s in MUST_MATCH if any(_under(n, (s,)) for n in fixed))
        raise CheckpointError(
            f"checkpoint {checkpoint} was saved with a different {sections}: "
            f"{_describe(fixed, saved_flat, current_flat)}; "
            f"resuming needs the same {' and '.join('config.' + s.rstrip('.') for s in MUST_MATCH)}"
        )
    if problem := _optimizer_change(saved_flat, current_flat, checkpoint) or _lora_change(saved_flat, current_flat, checkpoint):
        raise CheckpointError(problem)
    noted = [n for n in differing if not _under(n, FREE)]
    if not noted:
        return []
    note = (
        f"config differs from checkpoint {checkpoint} in {_describe(noted, saved_flat, current_flat)}: "
        f"the resumed run will not equal an uninterrupted one"
    )
    return [note]


def _optimizer_change(saved: dict, current: dict, checkpoint: str) -> str | None:
    """One line if the run asks for another optimizer, or the same one with other hyperparameters."""
    was, now = saved.get("train.optimizer", DEFAULT_OPTIMIZER), current.get("train.optimizer", DEFAULT_OPTIMIZER)
    allowed = "the learning rate, schedule and its length may change"
    if was != now:
        return (
            f"checkpoint {checkpoint} was saved with train.optimizer={was!r} but this run uses train.optimizer={now!r}: "
            f"optimizer state does not carry over; resume with {was!r} ({allowed})"
        )
    if now not in OPTIMIZER_NAMES:
        return None  # preflight names it
    keys = [f"train.{k}" for k in resume_keys(now)[1:]]
    changed = [k for k in keys if saved.get(k, _ABSENT) != current.get(k, _ABSENT)]
    if not changed:
        return None
    return (
        f"checkpoint {checkpoint} was saved with other {now} hyperparameters: {_describe(changed, saved, current)}; "
        f"its optimizer state means something else under them; resume with the saved values ({allowed})"
    )


# LoRA's keys that shape the saved adapters or say what they mean (`jaxpar.models.lora`).
LORA_KEYS = ("train.lora.rank", "train.lora.alpha", "train.lora.targets")


def _lora_change(saved: dict, current: dict, checkpoint: str) -> str | None:
    """One line if the run asks for other LoRA adapters than the checkpoint holds (or LoRA on / off)."""
    changed = [k for k in LORA_KEYS if saved.get(k, _ABSENT) != current.get(k, _ABSENT)]
    if not changed:
        return None
    return (
        f"checkpoint {checkpoint} was saved with other LoRA adapters: {_describe(changed, saved, current)}; resume with "
        f"the saved values (a new adapter on the same base: train.init_from_hf, or scripts/convert.py --to_hf first)"
    )
