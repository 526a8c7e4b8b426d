"""The layouts of a config on N devices: meshes, ZeRO stage, remat, sequence parallelism, microbatches.

`candidates(config, num_devices, space)` yields every `Candidate` — a set of config keys — whose
mesh has N devices; `admitted(config, num_devices, ...)` keeps those `jaxpar.train.preflight.check`
accepts and counts the refusals by reason. Both the compiled sweep (`jaxpar.analysis.reports.sweep`) and
the planner (`jaxpar.analysis.planner`) walk this one enumeration.

Meshes are the ordered factorisations of N over the five mesh axes. The expert axis is only
enumerated for MoE models: on a dense model it is data parallelism under another name (the batch
is split over data × expert and nothing else uses it), so it would only repeat the data meshes.
Context sizes are enumerated like any axis.

Knobs only vary where they matter: ZeRO stage when mesh.data > 1 (and its axes, data or data x
context, when mesh.context > 1 too), sequence parallelism when mesh.tensor > 1, the context-parallel
implementation when mesh.context > 1, schedule and
microbatch count when mesh.pipeline > 1, gradient accumulation otherwise.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import pickle
import re
from collections.abc import Iterable, Iterator

from ml_collections import ConfigDict, FieldReference

from jaxpar.axes import CONTEXT, DATA, EXPERT, MESH_AXES, PIPELINE, TENSOR
from jaxpar.models.families import facts
from jaxpar.parallel.pipeline.options import virtual_stages
from jaxpar.parallel.pipeline.schedules import SCHEDULES, schedule_kind
from jaxpar.parallel.zero import resolve_axes
from jaxpar.train.preflight import ConfigError, check, shared_sections

SCHEDULE_KEY = "parallel.pipeline_schedule"
MICROBATCH_KEY = "parallel.num_microbatches"
ACCUM_KEY = "train.grad_accum"
CONTEXT_IMPL_KEY = "parallel.context_impl"
CONTEXT_LATENT_KEY = "parallel.context_latent"
ZERO_AXES_KEY = "parallel.zero_axes"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Every k-tuple of positive integers whose product is n, in lexicographic order."""
    if k == 1:
        yield (n,)
        return
    for first in _divisors(n):
        for rest in factorizations(n // first, k - 1):
            yield (first,) + rest


def meshes(num_devices: int, *, moe: bool) -> Iterator[dict[str, int]]:
    for sizes in factorizations(num_devices, len(MESH_AXES)):
        mesh = dict(zip(MESH_AXES, sizes))
        if mesh[EXPERT] > 1 and not moe:
            continue
        yield mesh


@dataclasses.dataclass(frozen=True)
class Space:
    """Which values each knob may take. None: keep the config's value.

    `microbatch_options`: how many pipeline microbatch counts to try per mesh (the largest
    admissible, `_pipeline_counts`) and, if nonzero, every power-of-two gradient accumulation
    without a pipeline; 0 keeps the config's."""

    zero_stages: tuple | None = (0, 1, 3)
    remats: tuple | None = ("none", "save_dots", "full")
    sequence_parallel: tuple | None = (False, True)
    # Every schedule whose record says the planner searches it (`ScheduleKind.searched`; not gpipe):
    # interleaved and V runs store their layers in the schedule's order, so they move none per step
    # (`PipelineOptions.layers_in_schedule_order`) and may win. Searching zb_v and dualpipev too costs
    # little: 70B on 32 x A100, `plan_layouts` 53.3 CPU s without them, 52.1 with them; the search from
    # 8 up to the 32 that fit (`smallest_fitting_plan`) 56.5 -> 64.1.
    schedules: tuple | None = tuple(k.name for k in SCHEDULES if k.searched)
    microbatch_options: int = 4
    # > 0: every mesh splits each data replica's rows into microbatches of this many rows
    # (pipeline microbatches, or gradient accumulation without a pipeline), overriding the above.
    microbatch_rows: int = 0
    context_impls: tuple | None = ("all_gather", "ring", "all_to_all")  # with mesh.context > 1
    zero_axes: tuple | None = ("auto", DATA)  # with mesh.context > 1 and ZeRO: over data x context or data

    @classmethod
    def of_config(cls, zero_stages=(0, 1, 3), remats=None, microbatch_rows: int = 0) -> Space:
        """The sweep's default: ZeRO stages vary, everything else as the config says (or
        `microbatch_rows` rows per microbatch on every mesh)."""
        return cls(
            zero_stages=zero_stages, remats=remats, sequence_parallel=None, schedules=None, microbatch_options=0,
            microbatch_rows=microbatch_rows, context_impls=None, zero_axes=None,
        )


def _copy(config):
    # A pickle round trip copies a ConfigDict exactly (types, references, lock) 4x faster than
    # copy.deepcopy, whose `__deepcopy__` probe builds ml_collections' did-you-mean message every time.
    return pickle.loads(pickle.dumps(config))


@functools.lru_cache(maxsize=8)
def _defaults(kind: type) -> dict:
    """The attributes `kind()` gives a new instance (flags, and an empty `_fields` that `_shallow`
    replaces), read once per type: building a ConfigDict for each section copied was a fifth of
    `_with_keys`."""
    return dict(vars(kind()))


def _shallow(node):
    """A new ConfigDict holding the same fields (its sections shared, not copied), with the
    attributes a pickle round trip gives it (`ConfigDict.__setstate__`: the lock and type safety
    kept, `__init__`'s defaults for the rest); set directly, as `__setstate__` setting each field
    through `__setitem__` was most of the copy's time."""
    out = type(node).__new__(type(node))
    vars(out).update(_defaults(type(node)))
    vars(out).update(_fields=dict(node._fields), _locked=node._locked, _type_safe=node._type_safe,
                     _convert_dict=getattr(node, "_convert_dict", True))
    return out


# Leaf types `ConfigDict.__setitem__` stores unchanged over a field of the same type (no cast, no
# conversion): `_with_keys` writes those directly (the type checks per key were a tenth of the search).
_PLAIN = (int, str, bool)


def _with_keys(config, values: dict):
    """`set_keys` on a copy of `config` that copies only the sections holding `values`' keys (the
    planner's candidates set mesh, parallel and train leaves and share model, data and the rest:
    pickling the whole config for each was 20% of the search). Where a key is a FieldReference or
    sits deeper than a section's own leaf, the whole config is copied as before."""
    sections = set()
    for dotted in values:
        section, _, leaf = dotted.partition(".")
        node = config[section] if type(config) is ConfigDict and section in config else None
        if type(node) is not ConfigDict or "." in leaf or isinstance(node._fields.get(leaf), FieldReference):
            return set_keys(_copy(config), values)  # (a FrozenConfigDict, a reference or a deeper key)
        sections.add(section)
    out = _shallow(config)
    for section in sections:
        out._fields[section] = _shallow(config[section])
    for dotted, value in values.items():
        section, _, leaf = dotted.partition(".")
        fields = out._fields[section]._fields
        if type(value) in _PLAIN and type(fields.get(leaf)) is type(value):
            fields[leaf] = value
        else:
            out._fields[section][leaf] = value
    return out


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout: the config keys it sets (dotted names, e.g. "mesh.tensor")."""

    keys: tuple  # ((dotted key, value), ...)

    @functools.cached_property
    def values(self) -> dict:
        return dict(self.keys)

    @functools.cached_property
    def mesh(self) -> dict[str, int]:
        return {name: self.values[f"mesh.{name}"] for name in MESH_AXES}

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    def apply(self, config):
        """A copy of `config` with this candidate's keys set."""
        return _with_keys(config, self.values)

    def describe(self) -> str:
        v, mesh = self.values, self.mesh
        parts = [" ".join(f"{k}={s}" for k, s in mesh.items() if s > 1) or "1 device"]
        if mesh[DATA] > 1 and v.get("parallel.zero_stage"):
            stage = v["parallel.zero_stage"]
            spans = CONTEXT in resolve_axes(v.get(ZERO_AXES_KEY, "auto"), stage, mesh)
            parts.append(f"zero{stage}" + ("@dxc" if spans else ""))
        if mesh[TENSOR] > 1 and v.get("parallel.sequence_parallel"):
            parts.append("sp")
        if mesh[CONTEXT] > 1 and CONTEXT_IMPL_KEY in v:
            parts.append(f"cp={v[CONTEXT_IMPL_KEY]}")
        if "parallel.remat" in v:
            parts.append(f"remat={v['parallel.remat']}")
        if mesh[PIPELINE] > 1:
            vs = v.get("parallel.virtual_stages", 1)
            parts.append(f"{v.get(SCHEDULE_KEY, '?')} m={v.get(MICROBATCH_KEY, '?')}" + (f" v={vs}" if vs > 1 else ""))
        elif v.get(ACCUM_KEY, 1) > 1:
            parts.append(f"accum={v[ACCUM_KEY]}")
        return " ".join(parts)


def get_key(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def set_keys(config, values: dict):
    """Sets existing dotted keys in place (a locked ConfigDict allows that); returns `config`."""
    for dotted, value in values.items():
        *path, last = dotted.split(".")
        node = config
        for part in path:
            node = node[part]
        node[last] = value
    return config


# Fewest tokens per microbatch row block the planner will split a pipeline microbatch down to:
# the cost model prices matmuls at a fixed efficiency, but matmuls of a few hundred rows run far
# below peak on GPUs, so tiny microbatches would look free when they are not (a rule of thumb).
MIN_MICROBATCH_TOKENS = 4096


def _accum_counts(rows: int) -> list[int]:
    """1, 2, 4 ... dividing `rows`: gradient accumulation steps, fewest first."""
    return [a for a in (2**k for k in range(rows.bit_length())) if a <= rows and rows % a == 0]


def _pipeline_counts(p: int, rows: int, seq: int, options: int) -> list[int]:
    """The `options` largest microbatch counts m (multiples of p dividing `rows`, at least
    MIN_MICROBATCH_TOKENS tokens per microbatch, or m = p): more microbatches shrink both the
    bubble and the activations in flight."""
    min_rows = -(-MIN_MICROBATCH_TOKENS // seq)
    counts = [m for m in range(p, rows + 1, p) if rows % m == 0 and rows // m >= min_rows]
    return (counts or ([p] if rows and rows % p == 0 else []))[-options:]


def _knobs(config, mesh: dict, space: Space) -> Iterator[dict]:
    par, train = config.parallel, config.train
    d, p, t, e = mesh[DATA], mesh[PIPELINE], mesh[TENSOR], mesh[EXPERT]
    impls = (space.context_impls or (par.context_impl,)) if mesh[CONTEXT] > 1 else (None,)
    zeros = (space.zero_stages or (par.zero_stage,)) if d > 1 else (0,)
    remats = space.remats or (par.remat,)
    sps = (space.sequence_parallel or (par.sequence_parallel,)) if t > 1 else (None,)
    rows = train.global_batch_size // (d * e) if train.global_batch_size % (d * e) == 0 else 0
    split = max(1, rows // space.microbatch_rows) if space.microbatch_rows and rows else 0
    if p > 1 and split:
        v = virtual_stages(par)
        v = v if schedule_kind(par.pipeline_schedule).accepts(v) else 1
        layouts = [{SCHEDULE_KEY: par.pipeline_schedule, MICROBATCH_KEY: max(split, p), "parallel.virtual_stages": v, ACCUM_KEY: 1}]
    elif split:
        layouts = [{ACCUM_KEY: split}]
    elif p > 1:
        layouts = []
        for schedule in space.schedules or (par.pipeline_schedule,):
            if space.microbatch_options:
                counts = _pipeline_counts(p, rows, train.seq_len, space.microbatch_options)
            else:
                counts = [par.num_microbatches or p]
            kind = schedule_kind(schedule)
            # The planner's choice: each schedule's own v; else the config's (resolved).
            v = kind.default_virtual_stages if space.schedules else virtual_stages(par)
            for m in counts:
                if space.schedules and kind.problems(p, m, v):  # e.g. dualpipev below m = 2p
                    continue
                layouts.append({SCHEDULE_KEY: schedule, MICROBATCH_KEY: m, "parallel.virtual_stages": v, ACCUM_KEY: 1})
    elif space.microbatch_options:
        layouts = [{ACCUM_KEY: a} for a in _accum_counts(rows)]
    else:
        layouts = [{ACCUM_KEY: train.grad_accum}]
    # all_gather of a model with latents (MLA) moves them or the expanded K / V: both priced.
    latents = space.context_impls is not None and mesh[CONTEXT] > 1 and facts(config.model).kv_latent_width > 0
    contexts = [
        {CONTEXT_IMPL_KEY: impl, **({CONTEXT_LATENT_KEY: latent} if latents and impl == "all_gather" else {})}
        for impl in impls for latent in ((True, False) if latents and impl == "all_gather" else (None,))
    ] if impls != (None,) else [{}]
    for zero, remat, sp, context, layout in itertools.product(zeros, remats, sps, contexts, layouts):
        keys = {"parallel.zero_stage": zero, "parallel.remat": remat, **layout, **context}
        if sp is not None:
            keys["parallel.sequence_parallel"] = sp
        if mesh[CONTEXT] == 1 or not zero:
            yield keys
            continue
        seen = set()  # choices resolving to the same axes (ZeRO-3 with a pipeline: data) once
        for choice in space.zero_axes or (par.zero_axes,):
            axes = resolve_axes(choice, zero, mesh)
            if axes not in seen:
                seen.add(axes)
                yield {**keys, ZERO_AXES_KEY: choice}


def candidates(config, num_devices: int, space: Space | None = None, fixed: Iterable[str] = ()) -> Iterator[Candidate]:
    """Every layout of `config` on `num_devices` devices in `space`. Keys named in `fixed` keep
    the config's value: layouts that would change them are left out (mesh sizes of -1 match any)."""
    space = space or Space()
    fixed = set(fixed)
    moe = facts(config.model).is_moe
    for mesh in meshes(num_devices, moe=moe):
        for knobs in _knobs(config, mesh, space):
            values = {f"mesh.{name}": size for name, size in mesh.items()}
            values.update(knobs)
            if any(_conflicts(config, key, values[key]) for key in fixed if key in values):
                continue
            yield Candidate(tuple(values.items()))


def _conflicts(config, key: str, value) -> bool:
    current = get_key(config, key)
    return not (current == value or (key.startswith("mesh.") and current == -1))


def _reason(error: ConfigError) -> str:
    """The first error line with its numbers blanked, so equal reasons group together."""
    return re.sub(r"\d+", "N", str(error).splitlines()[0])[:140]


class Screen:
    """Preflight over candidates, counting refusals by reason.

    A mesh is screened once with its most permissive knobs (ZeRO 0, no sequence parallelism, no
    accumulation, pipeline m = p, v = 1): every knob only adds divisibility requirements, so a
    mesh refused then is refused for every knob setting, and its candidates are counted without
    running preflight on each."""

    def __init__(self, config, num_devices: int):
        self.config, self.num_devices = config, num_devices
        self.refused: collections.Counter = collections.Counter()
        self._mesh_refusal: dict = {}
        self._sections: dict = {}  # preflight's checks of the sections candidates share (`shared_sections`)
        self.last_refusal: str | None = None  # the reason `admit` counted last

    def sharing(self):
        """`shared_sections` for this screen's config, entered once around many `admit`s (each
        also enters it; a ContextVar set per candidate was 2% of the search)."""
        return shared_sections(self.config, self._sections)

    def _screen(self, mesh: dict) -> str | None:
        key = tuple(mesh.items())
        if key not in self._mesh_refusal:
            values = {f"mesh.{name}": size for name, size in mesh.items()}
            values.update({"parallel.zero_stage": 0, "parallel.sequence_parallel": False, ACCUM_KEY: 1})
            if mesh[PIPELINE] > 1:
                values.update({SCHEDULE_KEY: "1f1b", MICROBATCH_KEY: mesh[PIPELINE], "parallel.virtual_stages": 1})
            try:
                with self.sharing():
                    check(_with_keys(self.config, values), self.num_devices)
                self._mesh_refusal[key] = None
            except ConfigError as e:
                self._mesh_refusal[key] = _reason(e)
        return self._mesh_refusal[key]

    def admit(self, candidate: Candidate):
        """The config with the candidate applied, or None (refusal counted)."""
        reason = self._screen(candidate.mesh)
        if reason is None:
            applied = candidate.apply(self.config)
            try:  # the screen checked this config's keys and types; a candidate sets values of those keys
                with self.sharing():
                    check(applied, self.num_devices, keys_checked=True)
                return applied
            except ConfigError as e:
                reason = _reason(e)
        self.refused[reason] += 1
        self.last_refusal = reason
        return None

    def summary(self, limit: int = 3) -> str:
        total = sum(self.refused.values())
        if not total:
            return "preflight refused none"
        top = "; ".join(f"{n} x {reason}" for reason, n in self.refused.most_common(limit))
        return f"preflight refused {total}: {top}"


def admitted(config, num_devices: int, space: Space | None = None, fixed: Iterable[str] = ()):
    """([(candidate, config applied)], Screen with the refusals)."""
    screen = Screen(config, num_devices)
    accepted = []
    for candidate in candidates(config, num_devices, space, fixed):
        applied = screen.admit(candidate)
        if applied is not None:
            accepted.append((candidate, applied))
    return accepted, screen
