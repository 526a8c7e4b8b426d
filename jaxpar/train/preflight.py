"""Everything a run reads, checked before anything is written or compiled.

`check(config, num_devices, platform=None)` validates the config alone and raises `ConfigError`
listing every problem, one line each, each naming the config key to change: unknown and missing
keys (with the nearest known key), value types, ranges and choices, and every divisibility the mesh
needs. It only does arithmetic on the config; the checks themselves live with what they protect:
the family record's ranges and checks (`jaxpar.models.families`), each parallelism's module
(`jaxpar.parallel.*`), the train/checkpoint sections (`jaxpar.train.checks`), the data sources
(`jaxpar.data.sources`); this module runs them all.

`check_run(config, workdir, ...)` is the preflight of a whole run: the config, then the corpus
opened and checked (`corpus_problems`), then the workdir (`jaxpar.train.workdir.inspect`: writable,
not locked by a live run, and resumed or refused), then a `train.init_from_hf` checkpoint's config
and tensor headers (`jaxpar.interop.sharded.problems`). It reads, never writes.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import math
import os
import re
from dataclasses import dataclass

from ml_collections import ConfigDict

from jaxpar import models, objective
from jaxpar.axes import CONTEXT, DATA, MESH_AXES, PIPELINE
from jaxpar.checkpoint import tiers
from jaxpar.config import MOVED_KEYS, base_config
from jaxpar.data.checks import corpus_problems, validate_data_config
from jaxpar.downstream import harness as downstream
from jaxpar.interop import peft
from jaxpar.interop.sharded import problems as hf_problems
from jaxpar.mesh import MeshError, resolve_mesh_shape
from jaxpar.models import lora, lora_dropout
from jaxpar.models.families import FAMILIES, UnknownFamily, family
from jaxpar.parallel import collective_matmul, data, expert, tensor, zero
from jaxpar.parallel.context import plan as context
from jaxpar.parallel.pipeline import options as pipeline
from jaxpar.parallel.plan import ATTENTION_IMPLS, REMAT_NAMES
from jaxpar.ranges import one_of
from jaxpar.train import observe
from jaxpar.train import workdir as workdirs
from jaxpar.train.checks import checkpoint_checks, optimizer_checks, train_choices, train_ranges

# Half-precision compute dtypes cuDNN's fused attention takes.
CUDNN_DTYPES = ("bfloat16", "float16")


class ConfigError(ValueError):
    """One or more config problems, one line each."""


def flat_keys(config, prefix: str = "") -> list[str]:
    """Dotted names of every leaf key, e.g. `train.steps`, `model.rope_scaling.factor`."""
    keys = []
    for key in config.keys():
        value = config[key]
        keys += flat_keys(value, f"{prefix}{key}.") if isinstance(value, ConfigDict) else [f"{prefix}{key}"]
    return keys


def nearest_key(name: str, known) -> str | None:
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _unknown_keys(config, schema, known_flat, prefix="") -> list[str]:
    errors = []
    for key in config.keys():
        path = f"{prefix}{key}"
        if key not in schema and path in MOVED_KEYS:
            errors.append(f"{path}: the key moved to {MOVED_KEYS[path]}; set that instead")
        elif key not in schema:
            near = nearest_key(path, known_flat)
            hint = f"; did you mean {near}?" if near else f" (known here: {', '.join(sorted(schema.keys()))})"
            errors.append(f"{path}: unknown config key{hint}")
        elif isinstance(schema[key], ConfigDict) and isinstance(config[key], ConfigDict):
            errors.extend(_unknown_keys(config[key], schema[key], known_flat, path + "."))
    return errors


def _missing_keys(config, schema, schema_keys: list[str] | None = None) -> list[str]:
    """`schema_keys`: `flat_keys(schema)`, when the caller has them."""
    present = set(flat_keys(config))
    schema_keys = flat_keys(schema) if schema_keys is None else schema_keys
    missing = [k for k in schema_keys if k not in present and not any(k.startswith(p + ".") for p in present)]
    if not missing:
        return []
    return [
        f"config lacks {', '.join(missing)} (model.model_type={config.model.get('model_type')!r} needs them); "
        f"start from a config of that family (jaxpar.models.{config.model.get('model_type')}.model_config)"
    ]


def _type_name(kind) -> str:
    return {bool: "a bool", int: "an int", float: "a number", str: "a string"}.get(kind, kind.__name__)


def _type_problems(config, schema, prefix: str = "") -> list[str]:
    errors = []
    for key in config.keys():
        if key not in schema:
            continue
        value, path = config[key], f"{prefix}{key}"
        if isinstance(schema[key], ConfigDict):
            if isinstance(value, ConfigDict):
                errors += _type_problems(value, schema[key], path + ".")
            else:
                errors.append(f"{path}={value!r} must be a section with keys {', '.join(sorted(schema[key].keys()))}")
            continue
        kind = schema.get_type(key)
        if value is None and schema[key] is None:
            continue  # an optional key (placeholder), unset
        ok = {bool: lambda v: isinstance(v, bool), float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(
            kind, lambda v: isinstance(v, kind) and not (kind is int and isinstance(v, bool))  # noqa: B023 (called here)
        )(value)
        if not ok:
            errors.append(f"{path}={value!r} must be {_type_name(kind)}")
    return errors


@functools.cache
def _schema(model_type: str) -> tuple[ConfigDict, frozenset[str]]:
    """(the full schema of a `model_type` run, every key any family knows). Built once per family:
    the planner checks thousands of candidates, and rebuilding these took 35% of its time."""
    schema = base_config()
    schema.model = family(model_type).schema()
    schema.lock()  # read only: the checks never write to it
    known = flat_keys(base_config()) + [k for f in FAMILIES.values() for k in flat_keys(ConfigDict({"model": f.schema()}))]
    return schema, frozenset(known)


@functools.cache
def _schema_keys(model_type: str) -> tuple[str, ...]:
    """`flat_keys` of `_schema(model_type)`, once: the planner's screen of each mesh walked it again."""
    return tuple(flat_keys(_schema(model_type)[0]))


# Within `shared_sections(config, memo)`: the base config and the memo of `_once`.
_SHARED: contextvars.ContextVar = contextvars.ContextVar("preflight_shared", default=None)
_SCALARS = (int, float, str, bool, type(None))


@contextlib.contextmanager
def shared_sections(config, memo: dict):
    """Within it, checks of one section alone (`_once`) run once per distinct section of configs
    that share `config`'s sections or copy them shallowly with scalar leaves changed (the planner's
    candidates, `planner.candidates`: the model's ranges and facts and train's ranges were a quarter
    of preflight's time there). `memo` outlives the block; nothing may change `config` meanwhile."""
    current = _SHARED.get()
    if current is not None and current[0] is config and current[1] is memo:
        yield  # already within it (the planner enters once per search, its screen once per candidate)
        return
    token = _SHARED.set((config, memo))
    try:
        yield
    finally:
        _SHARED.reset(token)


def _section_key(section, base):
    """What tells `section` from `base`, a section whose non-scalar leaves it shares (the same
    objects): its changed scalar leaves; None when it is not such a copy."""
    if section is base:
        return ()
    if type(section) is not type(base) or section._fields.keys() != base._fields.keys():
        return None
    changed = tuple((k, type(v), v) for k, v in section._fields.items() if v is not base._fields[k])
    return changed if all(kind in _SCALARS for _, kind, _ in changed) else None


def _once(config, fn, *names, whole: bool = False, mesh: tuple = ()):
    """`fn` of the config's sections `names`; within `shared_sections`, once per distinct sections.
    `whole`: `fn(config)`, for a check that takes the whole config but reads only `names`.
    `mesh`: `(sizes,)` (a dict, or None) passed after them, once per distinct sections and sizes."""
    args = ((config,) if whole else tuple(config[n] for n in names)) + mesh
    shared = _SHARED.get()
    if shared is None:
        return fn(*args)
    base, memo = shared
    key = tuple(_section_key(config[n], base[n]) for n in names)
    if None in key:
        return fn(*args)
    key = (fn, names, key, tuple(m if m is None else tuple(m.items()) for m in mesh))
    if key not in memo:
        memo[key] = fn(*args)
    value = memo[key]
    return list(value) if isinstance(value, list) else value


# Sections `_section_checks` never reads: those a planner's candidates change with every layout. It reads
# the others (model, train, checkpoint, data, eval), so within `shared_sections` it runs once per mesh and train section.
_LAYOUT_SECTIONS = ("mesh", "parallel")


@dataclass(frozen=True)
class _SectionChecks:
    ranges: tuple  # the model's, train's and checkpoint's ranges: empty when sizes are sane
    family: tuple  # the family's own divisibilities for the mesh (all axes 1 without a valid one)
    facts: object  # the model's facts (None unless sane with a mesh)
    choices: tuple  # train's choices and the optimizer's checks
    objective: tuple
    data: tuple  # the data and eval sections, observability and the downstream harness


def _section_checks(config, mesh: dict | None) -> _SectionChecks:
    """The checks of `_config_problems` that read the mesh sizes and no section of `_LAYOUT_SECTIONS`."""
    fam = family(config.model.get("model_type", "llama"))
    ranges = tuple(fam.ranges(config.model) + train_ranges(config.train) + checkpoint_checks(config.checkpoint))
    sane = not ranges
    return _SectionChecks(
        ranges,
        # Without a valid mesh, the model alone (all axes 1): the family's own divisibilities.
        tuple(fam.checks(config.model, mesh or dict.fromkeys(MESH_AXES, 1))) if sane else (),
        fam.facts(config.model) if sane and mesh is not None else None,
        tuple(train_choices(config.train) + optimizer_checks(config.train, config.model)),
        tuple(objective.checks(config, mesh)),
        tuple(validate_data_config(config) + observe.checks(config) + downstream.checks(config)),
    )


def _config_problems(
    config, num_devices: int, platform: str | None, keys_checked: bool = False
) -> tuple[list[str], dict | None, bool]:
    """(problems, mesh sizes or None, whether model and train sizes are sane enough to read data with).
    `keys_checked`: the key set and value types were checked already (see `check`)."""
    try:
        fam = family(config.model.get("model_type", "llama"))
    except UnknownFamily as e:
        return [f"{e}; set model.model_type"], None, False
    errors = []
    if not keys_checked:
        schema, known = _schema(fam.name)
        errors = _unknown_keys(config, schema, known) + _missing_keys(config, schema, _schema_keys(fam.name))
        errors += [] if errors else _type_problems(config, schema)
    if errors:  # the remaining checks read values of the right keys and types
        return errors, None, False
    try:
        mesh = resolve_mesh_shape(config.mesh, num_devices)
    except MeshError as e:
        errors.append(str(e))
        mesh = None
    train, parallel = config.train, config.parallel
    alone = _once(config, _section_checks, *(k for k in config.keys() if k not in _LAYOUT_SECTIONS), whole=True, mesh=(mesh,))
    sane = not alone.ranges  # sizes >= 1: the divisibility checks below can run
    errors += alone.ranges + alone.family
    if sane and mesh is not None:
        errors += data.checks(config, mesh)
        errors += tensor.checks(config, mesh)
        errors += expert.overlap_checks(config, mesh)
        errors += zero.checks(config, mesh)
        facts = alone.facts
        errors += collective_matmul.problems(config, mesh, facts, fam.name, platform)
        errors += pipeline.checks(config, mesh, has_aux_losses=facts.is_moe, facts=facts)
        strategy = data.gradient_strategy(
            pipelined=mesh[PIPELINE] > 1, grad_accum=train.grad_accum, data_size=mesh[DATA], context_size=mesh[CONTEXT],
            zero_shards_params=parallel.zero_stage == 3, has_aux_losses=facts.is_moe)
        if train.get("fp8", "none") != "none" and strategy is data.GradientStrategy.PER_REPLICA:
            # Each replica's vmapped accumulation would scale by its own amax, not the global one.
            errors.append(f"train.fp8={train.fp8!r} with mesh.data={mesh[DATA]} and train.grad_accum={train.grad_accum} is not "
                          "supported yet (each data replica would take its own amax); use parallel.zero_stage=3 or "
                          "train.grad_accum=1")
        # Backend-dependent (ring inside pipeline branches deadlocks on XLA:CPU): checked when known.
        errors += context.checks(config, mesh, backend=platform)
    errors += one_of("parallel.remat", parallel.remat, ("auto", *REMAT_NAMES))
    errors += one_of("parallel.attention_impl", parallel.attention_impl, ATTENTION_IMPLS)
    errors += alone.choices
    if sane and "lora" in train:
        errors += lora.problems(train.lora, lambda: models.logical_axes(config.model))
        if not errors:
            misses = lambda: models.side_path_misses(lora.adapted(config.model, train.lora))  # noqa: E731
            errors += lora_dropout.problems(train.lora, train.grad_accum, mesh[PIPELINE] if mesh else 1, misses)
        if not errors and train.lora.init_from_peft:
            try:  # the adapter's rank, alpha, targets and every tensor's shape, before anything compiles
                peft.load(train.lora.init_from_peft, lora.adapted(config.model, train.lora))
            except ValueError as e:
                errors.append(f"train.lora.init_from_peft={train.lora.init_from_peft}: {e}")
    errors += alone.objective
    if parallel.attention_impl == "cudnn" and platform is not None:
        if platform != "gpu":
            errors.append(f"parallel.attention_impl='cudnn' needs a GPU but this run has {platform} devices; set it to 'auto' or 'xla'")
        elif train.compute_dtype not in CUDNN_DTYPES:
            errors.append(f"parallel.attention_impl='cudnn' needs train.compute_dtype in {CUDNN_DTYPES}; set it to 'auto' or 'xla'")
    if sane and train.seq_len > config.model.max_position_embeddings:
        errors.append(f"train.seq_len={train.seq_len} exceeds model.max_position_embeddings={config.model.max_position_embeddings}")
    errors += alone.data
    if not keys_checked:  # a planner candidate changes layout keys only (ints, strings)
        errors += _nonfinite_problems(config, errors)
    return without_cascades(errors), mesh, sane


def _nonfinite_problems(config, errors: list[str]) -> list[str]:
    """nan / inf in any float key no other check named (a learning rate of inf passes `> 0`)."""
    found = []
    for key in flat_keys(config):
        value = config
        for part in key.split("."):
            value = value[part]
        if isinstance(value, float) and not math.isfinite(value) and not any(f"{key}=" in line for line in errors):
            found.append(f"{key}={value!r} must be a finite number")
    return found


# "KEY=VALUE must be ...": the value itself is wrong, so any later line that computed with it is its cascade.
_RANGE_LINE = re.compile(r"^([\w.\[\]]+=[^ ]+) must be")


def without_cascades(errors: list[str]) -> list[str]:
    """`errors` once each, less the lines that repeat a value an earlier line refused outright (`model.vocab_size=0
    must be >= 1` makes `model.vocab_size=0 is below the byte tokenizer's 256` its cascade): the first error, not its cascade."""
    kept, refused = [], []
    for line in dict.fromkeys(errors):
        if any(re.search(re.escape(subject) + r"(?![\w.])", line) for subject in refused):
            continue
        kept.append(line)
        if match := _RANGE_LINE.match(line):
            refused.append(match.group(1))
    return kept


def check(config, num_devices: int, platform: str | None = None, *, keys_checked: bool = False) -> dict[str, int]:
    """Validates `config` for `num_devices` devices of `platform` ("cpu", "gpu", "tpu"; None: skip
    the backend-dependent checks); returns the resolved mesh sizes. `keys_checked=True` skips the
    unknown / missing key and type checks, for a config that differs from one that passed them
    only in values of the same keys and types (the planner's candidates: those checks were 40%
    of its time on the 70B)."""
    errors, mesh, _ = _config_problems(config, num_devices, platform, keys_checked)
    if errors:
        raise ConfigError("\n".join(errors))
    return mesh


@dataclass(frozen=True)
class Preflight:
    mesh: dict[str, int]
    workdir: workdirs.WorkdirPlan


def check_run(
    config, workdir: str, num_devices: int, platform: str | None, *, overwrite: bool = False, owns_workdir: bool = True
) -> Preflight:
    """The whole run's preflight (module docstring); raises ConfigError with every problem.
    `owns_workdir=False` (processes other than 0, which never write it): the workdir is not inspected."""
    errors, mesh, sane = _config_problems(config, num_devices, platform)
    errors += tiers.checks(config, workdirs.checkpoint_dir(config, workdir))
    if sane:
        errors += corpus_problems(config)
        errors += downstream.task_problems(config)  # imports lm-eval only when the harness is on
    if owns_workdir:
        plan, workdir_problems = workdirs.inspect(config, workdir, overwrite=overwrite)
    else:
        plan, workdir_problems = workdirs.WorkdirPlan(workdir, workdirs.checkpoint_dir(config, workdir), None, False, ()), []
    hf_dir = config.train.init_from_hf if sane else ""
    if hf_dir and os.path.isdir(hf_dir) and plan is not None and plan.resume_step is None:
        errors += hf_problems(hf_dir, config.model)
    errors = without_cascades(errors + workdir_problems)
    if errors:
        raise ConfigError("\n".join(errors))
    return Preflight(mesh, plan)


__all__ = ["ConfigError", "Preflight", "check", "check_run", "flat_keys", "nearest_key"]
