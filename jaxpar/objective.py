"""`train.objective`: what the training step minimises, and DPO's keys (`train.dpo`) and checks.
The DPO loss itself: `jaxpar.train.dpo`."""

from __future__ import annotations

from typing import NamedTuple

from jaxpar.ranges import one_of, positive, within

OBJECTIVES = ("lm", "dpo")
KEYS = {"beta": 0.1, "label_smoothing": 0.0}
MEANINGS = {
    "train.objective": "what the step minimises: lm (next-token loss over the targets the data counts) or dpo (direct "
    "preference optimisation of data.format='preference' pairs against a frozen reference: the starting weights, "
    "or with LoRA the base)",
    "train.dpo.beta": "DPO: β, the strength of the implicit KL penalty against the reference",
    "train.dpo.label_smoothing": "DPO: ε, the assumed probability that a pair's preference is flipped (conservative "
    "DPO; 0: the plain sigmoid loss)",
}


class Dpo(NamedTuple):
    beta: float
    label_smoothing: float


def settings(train) -> Dpo | None:
    """The run's DPO settings, None for objective lm."""
    if train.get("objective", "lm") != "dpo":
        return None
    return Dpo(float(train.dpo.beta), float(train.dpo.label_smoothing))


def checks(config, mesh) -> list[str]:
    """One line per problem: the objective, β, ε and the data format (DPO runs on every mesh)."""
    train = config.train
    errors = one_of("train.objective", train.get("objective", "lm"), OBJECTIVES)
    formats = sorted({s.get("format", config.data.format) for s in _entries(config.data)})
    if errors:
        return errors
    if train.objective != "dpo":
        if "preference" in formats:
            errors.append("data.format='preference' holds preference pairs, which only train.objective='dpo' trains; "
                          "set train.objective='dpo'")
        return errors
    errors += positive("train.dpo.beta", train.dpo.beta)
    errors += within("train.dpo.label_smoothing", train.dpo.label_smoothing, 0.0, 0.5, high_open=True)
    if formats != ["preference"]:
        errors.append(f"train.objective='dpo' trains preference pairs, but data.format is {'/'.join(formats)}; set "
                      f"data.format='preference' (records with prompt, chosen, rejected)")
    return errors


def _entries(data) -> list:
    mixture = data.get("mixture")
    return list(mixture) if isinstance(mixture, (list, tuple)) and mixture else [{}]


__all__ = ["KEYS", "MEANINGS", "OBJECTIVES", "Dpo", "checks", "settings"]
