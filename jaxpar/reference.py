"""The config reference, docs/config.md: every key with its default and meaning, and every record.

Generated, never typed: the keys and defaults come from the schema (`jaxpar.config.base_config`, each
family's `config.model` schema, each optimizer's and learning-rate schedule's section), the meanings
from the tables beside them (`jaxpar.config.MEANINGS`, `jaxpar.models.schema.MEANINGS`, each record's
`Hyperparameter.meaning`), and the record tables from the records themselves (families, pipeline
schedules, optimizers, learning-rate schedules, attention kernels, context-parallel implementations).
A key without a meaning, or a meaning without a key, is an error here, so the reference cannot
fall behind the schema. `python scripts/docs.py config` writes it; tests/docs/test_config_reference.py
fails when docs/config.md differs from `render()`.

Nothing in jaxpar imports this module: it reads the whole library and only the docs read it.
"""

from __future__ import annotations

import math

from ml_collections import ConfigDict, FieldReference

from jaxpar import config as schema
from jaxpar import optim
from jaxpar.axes import DATA
from jaxpar.models import families
from jaxpar.models import moe as moe_options
from jaxpar.models import schema as model_schema
from jaxpar.parallel import plan, zero
from jaxpar.parallel.context import sharded as context
from jaxpar.parallel.pipeline import balance, checks, schedules

PATH = "docs/config.md"
# The sizes the schedule table is measured at (every schedule takes them; the V shapes need v = 2).
P, M = 4, 8
# The weights the optimizer table prices state for: Llama 3 8B's stacked MLP matrices, float32.
MATRIX, MATRIX_NAMES = (32, 4096, 14336), ("layers", "embed", "mlp")
# The sections in reading order (a section the schema adds later comes after them). The data
# section's name is also the data axis's, spelled once in jaxpar.axes.
ORDER = ("model", "mesh", "parallel", "train", DATA, "eval", "checkpoint")

# Words for the records that carry no meaning of their own (names only): one line each.
KERNELS = {
    "auto": "picks one of the others for the backend and compute dtype (the last column)",
    "xla": "jax.nn.dot_product_attention's XLA path",
    "cudnn": "jax.nn.dot_product_attention's cuDNN path (GPU)",
    "jaxpar_xla": "jaxpar's own flash-style kernel in plain XLA with a hand-written backward "
    "(`jaxpar/kernels/attention.py`)",
}
CONTEXT_IMPLS = {
    "all_gather": "all-gather the keys and values of the whole sequence (only the KV heads travel); holds them while "
    "attending",
    "ring": "pass key / value blocks around the ring, c - 1 collective-permutes, each overlappable with a block of "
    "work; never more than two blocks held",
    "all_to_all": "DeepSpeed-Ulysses: all-to-alls trade the sequence split for a head split (whole sequences, 1/c of "
    "the heads) and back; needs the heads per device divisible by c",
}


class ReferenceError(ValueError):
    """The schema and the meanings disagree (a key without a meaning, or the reverse)."""


# -- the allowed values of keys that name records or a fixed set ----------------------------------


def choices() -> dict[str, tuple]:
    """`section.key` -> its allowed values, from the records and the modules that own them."""
    from jaxpar import fp8
    from jaxpar.data.corpus import TEXT_DOCUMENTS
    from jaxpar.data.sources import SOURCES
    from jaxpar.dtypes import DTYPES
    from jaxpar.trackers import NAMES as TRACKERS
    from jaxpar.trackers import WANDB_MODES
    from jaxpar.train.checks import NONFINITE_POLICIES

    return {
        "model.model_type": tuple(families.FAMILIES),
        "model.rope_scaling.rope_type": model_schema.ROPE_TYPES,
        "model.scoring_func": moe_options.SCORING_FUNCS,
        "parallel.zero_stage": zero.STAGES,
        "parallel.zero_axes": zero.AXES_CHOICES,
        "parallel.remat": ("auto", *plan.REMAT_NAMES),
        "parallel.attention_impl": plan.ATTENTION_IMPLS,
        "parallel.pipeline_schedule": schedules.SCHEDULE_NAMES,
        "parallel.pipeline_vocab": balance.PLACEMENTS,
        "parallel.context_impl": tuple(context.IMPLS),
        "train.optimizer": optim.OPTIMIZER_NAMES,
        "train.lr_schedule": optim.SCHEDULE_NAMES,
        "train.fp8": fp8.RECIPE_NAMES,
        "train.param_dtype": tuple(DTYPES),
        "train.compute_dtype": tuple(DTYPES),
        "train.on_nonfinite": NONFINITE_POLICIES,
        "train.loggers": TRACKERS,
        "train.wandb_mode": WANDB_MODES,
        "data.source": SOURCES,
        "data.text_documents": TEXT_DOCUMENTS,
    }


# -- formatting ------------------------------------------------------------------------------------


def value_text(value) -> str:
    """A default as a code span, as it would be typed in a config file."""
    if isinstance(value, FieldReference):
        value = value.get()
    if isinstance(value, str):
        text = f'"{value}"'
    elif isinstance(value, (list, tuple)):
        text = repr(list(value))
    else:
        text = repr(value)
    return "`" + text.replace("|", "\\|") + "`"


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def code(name) -> str:
    return f"`{name}`"


# -- keys ------------------------------------------------------------------------------------------


def leaves(section: ConfigDict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, default) of every leaf of a section, nested sections flattened, in schema order."""
    found = []
    for name, value in section.items():
        if isinstance(value, ConfigDict):
            found += leaves(value, f"{prefix}{name}.")
        else:
            found.append((prefix + name, value))
    return found


def record_sections() -> dict[str, tuple]:
    """`train.<record>` -> that record's hyperparameters (optimizers' and learning-rate schedules')."""
    return {f"train.{name}": keys for name, keys in optim.SECTIONS.items()}


def key_rows(section: str, config: ConfigDict, meanings: dict[str, str], known: dict) -> list[tuple]:
    """The rows of one section's table (record-owned sub-sections left out); adds each key to `known`."""
    allowed, rows = choices(), []
    owned = record_sections()
    for key, default in leaves(config):
        full = f"{section}.{key}"
        if any(full.startswith(prefix + ".") for prefix in owned):
            continue
        if full not in meanings:
            raise ReferenceError(f"{full} has no meaning: add one to the table beside its schema")
        meaning = meanings[full]
        if full in allowed:
            meaning += "; one of " + ", ".join(code(c) for c in allowed[full])
        known[full] = meaning
        rows.append((code(full), value_text(default), cell(meaning)))
    return rows


def _stale(meanings: dict[str, str], known: dict, where: str) -> None:
    stale = sorted(set(meanings) - set(known))
    if stale:
        raise ReferenceError(f"{where} gives meanings for keys the schema does not have: {', '.join(stale)}")


def sections(config: ConfigDict) -> list[str]:
    """The config's sections in reading order."""
    return [s for s in ORDER if s in config] + sorted(s for s in config.keys() if s not in ORDER)


def record_section(prefix: str, keys) -> list[str]:
    """One record's own section (`train.adamw`): who reads it, and its keys with their ranges."""
    name = prefix.split(".", 1)[1]
    readers = [o.name for o in optim.OPTIMIZERS if name in o.sections]
    readers += [s.name for s in optim.SCHEDULES if s.name == name]
    chooser = "train.optimizer" if any(o.name == name for o in optim.OPTIMIZERS) else "train.lr_schedule"
    out = [f"### {prefix}", "", f"Read when `{chooser}` is {' or '.join(code(r) for r in readers)}.", ""]
    rows = [(code(f"{prefix}.{h.name}"), value_text(h.default), f"`{cell(h.range)}`" if h.range else "any", cell(h.meaning))
            for h in keys]
    return out + table(("key", "default", "range", "meaning"), rows)


def section_pages(config: ConfigDict) -> list[str]:
    """Every section but model (its own page), each followed by the record sections inside it."""
    out, known = [], {}
    for section in sections(config):
        if section == "model":
            continue
        out += [f"## {section}", ""]
        out += table(("key", "default", "meaning"), key_rows(section, config[section], schema.MEANINGS, known))
        for prefix, keys in record_sections().items():
            if prefix.startswith(section + "."):
                out += record_section(prefix, keys)
    _stale(schema.MEANINGS, known, "jaxpar/config.py MEANINGS")
    return out


def model_page() -> list[str]:
    """The model keys every family shares (Llama's defaults), then each family's own keys and defaults."""
    meanings, allowed = model_schema.MEANINGS, choices()
    shared = model_schema.decoder_config()
    seen = set()

    def row(key, default):
        if key not in meanings:
            raise ReferenceError(f"model.{key} has no meaning: add one to jaxpar/models/schema.py MEANINGS")
        seen.add(key)
        meaning = meanings[key]
        if f"model.{key}" in allowed:
            meaning += "; one of " + ", ".join(code(c) for c in allowed[f"model.{key}"])
        return (code(f"model.{key}"), value_text(default), cell(meaning))

    out = ["## model", "",
           "The keys every family shares, named as in its transformers config, with Llama's defaults "
           "(`jaxpar/models/schema.py`). Each family's own keys and defaults: [model families](#model-families).", ""]
    out += table(("key", "default", "meaning"), [row(k, v) for k, v in leaves(shared)])
    families_out = ["## Model families", "",
                    "`model.model_type` picks the family; a config starts from the family's schema "
                    "(`jaxpar.models.<family>.model_config`). Beyond the shared keys above:", ""]
    shared_defaults = dict(leaves(shared))
    rows, details = [], []
    for name, record in families.FAMILIES.items():
        keys = leaves(record.schema())
        own = [k for k, _ in keys if k not in shared_defaults]
        kind = "dense" if record.aux_losses is None else "mixture of experts"
        rows.append((code(name), record.hf.hf_class, kind, ", ".join(code(k) for k in own) or "none"))
        changed = [(k, v) for k, v in keys if k != "model_type" and (k not in shared_defaults or shared_defaults[k] != v)]
        details += [f"### {name}", "", f"Keys and defaults that differ from the shared ones ({record.hf.hf_class}):", ""]
        details += table(("key", "default", "meaning"), [row(k, v) for k, v in changed]) if changed else ["none", ""]
    _stale(meanings, {k: None for k in seen}, "jaxpar/models/schema.py MEANINGS")
    return out + families_out + table(("family", "transformers class", "kind", "its own keys"), rows) + details


# -- records ---------------------------------------------------------------------------------------


def _microbatches(kind) -> str:
    """The microbatch counts a schedule takes, in terms of p (read off its constraints at p = P)."""
    v = kind.default_virtual_stages
    accepted = [m for m in range(1, 4 * P + 1) if not kind.problems(P, m, v)]
    if accepted == list(range(1, 4 * P + 1)):
        return "any"
    if accepted == [m for m in range(1, 4 * P + 1) if m % P == 0]:
        return "a multiple of p"
    if accepted == list(range(accepted[0], 4 * P + 1)) and accepted[0] % P == 0:
        return f"at least {accepted[0] // P if accepted[0] > P else ''}p".replace("at least 1p", "at least p")
    return "one of " + ", ".join(map(str, accepted)) + f" (p = {P})"


def schedule_rows() -> list[tuple]:
    rows = []
    for kind in schedules.SCHEDULES:
        v = kind.default_virtual_stages
        table_ = kind.table(P, M, v)
        takes = f"any (0: {v})" if kind.virtual_stages is None else " or ".join(map(str, kind.virtual_stages))
        rows.append((
            code(kind.name), takes, "B and W" if kind.split_backward else "whole", _microbatches(kind),
            f"{kind.bubble(P, M, v):.3f}", f"{schedules.bubble_fraction(table_):.3f}",
            ", ".join(map(str, checks.peak_in_flight(table_))),
        ))
    return rows


def optimizer_rows() -> list[tuple]:
    train = schema.base_config().train
    elements = math.prod(MATRIX)
    rows = []
    for record in optim.OPTIMIZERS:
        leaves_ = record.state(train, MATRIX, MATRIX_NAMES)
        per = record.state_bytes(train, MATRIX, MATRIX_NAMES) / elements
        fields = ", ".join(leaf.field for leaf in leaves_) or "none"
        sections = ", ".join(code(f"train.{s}") for s in record.sections if s in optim.SECTIONS) or "none"
        rows.append((code(record.name), sections, fields, f"{per:.3g}"))
    return rows


def record_pages() -> list[str]:
    out = ["## Pipeline schedules", "",
           f"`parallel.pipeline_schedule` (read when `mesh.pipeline` > 1). Measured on each schedule's own table at "
           f"p = {P} ranks, m = {M} microbatches and the schedule's own virtual stages; the textbook bubble is the "
           "record's formula. Drawn, with formulas: [pipeline schedules](pipeline_schedules.md).", ""]
    out += table(("schedule", "`parallel.virtual_stages`", "backward", "microbatches", "bubble (textbook)",
                  "bubble (its table)", "peak stash per rank"), schedule_rows())
    out += ["## Optimizers", "",
            f"`train.optimizer`. State per parameter for float32 weights shaped like Llama 3 8B's stacked MLP matrices "
            f"{list(MATRIX)} (Adafactor factors each matrix; Muon keeps AdamW's state for embeddings, head and norms); "
            "ZeRO-1 and ZeRO-3 split every leaf over the ZeRO axes.", ""]
    out += table(("optimizer", "sections it reads", "state leaves", "state bytes per parameter"), optimizer_rows())
    out += ["## Learning-rate schedules", "",
            "`train.lr_schedule`: each warms up linearly over `train.warmup_steps` to `train.learning_rate`, and ends "
            "at `learning_rate × final_learning_rate_fraction` after `train.steps` updates.", ""]
    rows = [(code(s.name), code(f"train.{s.name}") if s.name in optim.SECTIONS else "none") for s in optim.SCHEDULES]
    out += table(("schedule", "its section"), rows)
    out += ["## Attention kernels", "", "`parallel.attention_impl`.", ""]
    rows = []
    for name in plan.ATTENTION_IMPLS:
        if name not in KERNELS:
            raise ReferenceError(f"attention kernel {name!r} has no words in jaxpar/reference.py KERNELS")
        picked = [f"{backend} {dtype}" for backend in ("cpu", "gpu", "tpu") for dtype in ("float32", "bfloat16")
                  if plan.resolve_attention("auto", dtype, backend) == name]
        rows.append((code(name), cell(KERNELS[name]), ", ".join(picked) or "-"))
    out += table(("kernel", "what it is", "`auto` picks it on"), rows)
    out += ["## Context-parallel implementations", "",
            "`parallel.context_impl` (read when `mesh.context` > 1); their collectives per attention call: "
            "[context parallelism](parallelism/context.md).", ""]
    missing = sorted(set(context.IMPLS) - set(CONTEXT_IMPLS))
    if missing:
        raise ReferenceError(f"context implementations without words in jaxpar/reference.py: {', '.join(missing)}")
    out += table(("implementation", "how attention reaches the other ranks' keys and values"),
                 [(code(name), cell(CONTEXT_IMPLS[name])) for name in context.IMPLS])
    return out


def render() -> str:
    """docs/config.md's text."""
    config = schema.base_config()
    head = [
        "# Config reference", "",
        "Generated by `python scripts/docs.py config` from the schema (`jaxpar/config.py`, each family's "
        "`config.model` schema, each optimizer's and schedule's section) and the records; do not edit it by hand: "
        "`tests/docs/test_config_reference.py` fails when it differs. Set a key with `--config.SECTION.KEY=VALUE` "
        "([training and configs](training.md#configs)); preflight refuses unknown keys and values out of range.", "",
        "Sections: " + " · ".join(f"[{s}](#{s})" for s in sections(config)) + ". Records: [model families](#model-families) · "
        "[pipeline schedules](#pipeline-schedules) · [optimizers](#optimizers) · "
        "[learning-rate schedules](#learning-rate-schedules) · [attention kernels](#attention-kernels) · "
        "[context-parallel implementations](#context-parallel-implementations).", "",
    ]
    model = model_page()
    split = model.index("## Model families")
    return "\n".join(head + model[:split] + section_pages(config) + model[split:] + record_pages()).rstrip() + "\n"
