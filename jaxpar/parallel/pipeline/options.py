"""Pipeline options from `config.parallel` and the model's facts, decided once, and the config checks they need."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from jaxpar.axes import DATA, EXPERT, PIPELINE, TENSOR
from jaxpar.model_facts import padded_vocab_size
from jaxpar.parallel.pipeline.balance import AUTO, PLACEMENTS, auto_split, parse_split, split_problems
from jaxpar.parallel.pipeline.layout import storage_order
from jaxpar.parallel.pipeline.schedules import SCHEDULE_NAMES, ScheduleKind, schedule_kind
from jaxpar.parallel.pipeline.slots import SlotPlan, build_slot_plan
from jaxpar.parallel.pipeline.table import Schedule


@dataclass(frozen=True)
class PipelineOptions:
    """What the engine, the rules table and the analysis read. `schedule` is the record (a name is
    looked up, so options can be stated by hand). Its table, the auto stage split and the slot
    plan are built when first read: the planner prices thousands of plans and needs none of them
    (the rules table reads only `shard_layers`; the cost model the record's shape of the table). A
    table may also be given (`given_table`, e.g. a hand-made one in a test). The engine, the slot
    plan and the layout read the table's stage map."""

    schedule: ScheduleKind | str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    num_ranks: int = 1  # mesh.pipeline
    layers: int = 0  # the model's staged decoder layers (`ModelFacts.pipeline_layers`)
    vocab: str = "spread"  # where embedding / head run: a `balance.PLACEMENTS` entry (see `vocab.py`)
    # `parallel.pipeline_stage_layers`: an explicit split (layers per global stage, placed by the
    # table's stage map), or AUTO, balanced from the model's facts at `seq_len`.
    split: tuple | str = AUTO
    facts: object = None  # the model's `jaxpar.model_facts.ModelFacts` (read by AUTO only)
    seq_len: int = 0
    # The [L, ...] layer stacks are stored in the schedule's order (`layout.storage_order`), so each
    # rank's stages are already in its block and the engine exchanges no layers. The engine reads
    # stacks in that order (and returns gradients in it). `pipeline_options` decides it
    # (`stores_in_schedule_order`); the train state applies it when built or restored and undoes it
    # for checkpoints and whoever reads the state (`pipeline/order.py`, `jaxpar.train.setup`).
    layers_in_schedule_order: bool = False
    # Not compared or hashed: a function of the fields above (plans are cache keys in the analysis).
    given_table: Schedule | None = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "schedule", schedule_kind(self.schedule))
        t = self.given_table
        if t is not None and (t.num_ranks, t.num_microbatches, t.virtual_stages) != (
            self.num_ranks, self.microbatches, self.virtual_stages
        ):
            raise ValueError(
                f"table {t.name!r} (p={t.num_ranks}, m={t.num_microbatches}, v={t.virtual_stages}) does not fit "
                f"p={self.num_ranks}, m={self.microbatches}, v={self.virtual_stages}"
            )

    @functools.cached_property
    def table(self) -> Schedule:
        """The schedule's table for these ranks, microbatches and virtual stages (up to ~0.3 s at
        m = 512, so built when first read)."""
        if self.given_table is not None:
            return self.given_table
        return self.schedule.table(self.num_ranks, self.microbatches, self.virtual_stages)

    @functools.cached_property
    def stage_layers(self) -> tuple:
        """Layers per global stage: the explicit split, or the auto split on the table, computed
        when first read (a schedule simulation, ~20 ms at 70B)."""
        if self.split != AUTO:
            return tuple(self.split)
        return auto_split(self.facts, self.seq_len, self.table, placement=self.vocab)

    @functools.cached_property
    def stored_order(self) -> tuple | None:
        """The layer id at each storage position, or None for the natural order."""
        if not self.layers_in_schedule_order:
            return None
        return storage_order(self.stage_layers, self.num_ranks, self.virtual_stages, self.table.stages)

    @property
    def shard_layers(self) -> bool:
        """The [L, ...] layer stacks split over `pipeline` (else replicated: see `layout.py`)."""
        return self.layers % self.num_ranks == 0

    @functools.cached_property
    def slot_plan(self) -> SlotPlan:
        """The engine's branch and buffer-slot tables for `table`, built once per options."""
        return build_slot_plan(self.table)


def stores_in_schedule_order(layers: int, p: int, v: int) -> bool:
    """Whether a run keeps its layer stacks in the schedule's order: whenever its stages are not
    its storage blocks in the natural order (v > 1: interleaved, or a V shape) and the stacks are
    split over `pipeline` (L % p == 0; replicated stacks move no layers in either order). With an
    equal split the staged view is then a free reshape; with an uneven one only the layers beyond
    a rank's block move (`layout.storage_order`). With v = 1 on the modular map the schedule's
    order is the natural one, so nothing is permuted."""
    return p > 1 and v > 1 and layers % p == 0


def virtual_stages(parallel) -> int:
    """`parallel.virtual_stages` resolved: 0 is the schedule's own (its record's
    `default_virtual_stages`). Read through `PipelineOptions.virtual_stages` everywhere else."""
    return schedule_kind(parallel.pipeline_schedule).resolve_virtual_stages(parallel.virtual_stages)


def pipeline_options(config, mesh: dict, facts) -> PipelineOptions | None:
    """None when the pipeline axis is 1. `parallel.num_microbatches` 0 means mesh.pipeline,
    `parallel.virtual_stages` 0 the schedule's own."""
    p = mesh[PIPELINE]
    if p == 1:
        return None
    parallel = config.parallel
    v = virtual_stages(parallel)
    return PipelineOptions(
        schedule=parallel.pipeline_schedule,
        microbatches=parallel.num_microbatches or p,
        virtual_stages=v,
        num_ranks=p,
        layers=facts.pipeline_layers,
        layers_in_schedule_order=stores_in_schedule_order(facts.pipeline_layers, p, v),
        vocab=parallel.pipeline_vocab,
        split=parse_split(parallel.pipeline_stage_layers),
        facts=facts,
        seq_len=config.train.seq_len,
    )


def checks(config, mesh: dict, *, has_aux_losses: bool, facts=None) -> list[str]:
    """One line per problem, each naming the key to change. `facts`: the model's `ModelFacts`
    (None: every decoder layer staged, no multi-token prediction)."""
    parallel, train, model = config.parallel, config.train, config.model
    errors = []
    name, v, m = parallel.pipeline_schedule, parallel.virtual_stages, parallel.num_microbatches
    kind = None
    if name not in SCHEDULE_NAMES:
        errors.append(f"parallel.pipeline_schedule={name!r} is not one of {SCHEDULE_NAMES}")
    else:
        kind = schedule_kind(name)
    if v < 0:
        errors.append(f"parallel.virtual_stages={v} must be >= 0 (0: the schedule's own)")
    elif kind:
        v = kind.resolve_virtual_stages(v)
        if problem := kind.virtual_stage_problem(v):
            errors.append(problem)
    if m < 0:
        errors.append(f"parallel.num_microbatches={m} must be >= 1 (or 0: mesh.{PIPELINE})")
    if parallel.pipeline_vocab not in PLACEMENTS:
        errors.append(f"parallel.pipeline_vocab={parallel.pipeline_vocab!r} is not one of {PLACEMENTS}")
    key = "parallel.pipeline_stage_layers"
    try:
        split = parse_split(parallel.pipeline_stage_layers)
    except ValueError as e:
        errors.append(f"{key}: {e}")
        split = AUTO
    p = mesh[PIPELINE]
    if p == 1 or errors:
        return errors
    m = m or p
    replicas = mesh[DATA] * mesh[EXPERT]
    if train.global_batch_size % (replicas * m):
        errors.append(
            f"parallel.num_microbatches={m} does not divide the per-replica batch "
            f"(train.global_batch_size={train.global_batch_size} / (mesh.{DATA} × mesh.{EXPERT})={replicas}); "
            "change parallel.num_microbatches or train.global_batch_size"
        )
    if train.grad_accum != 1:
        errors.append(
            f"train.grad_accum={train.grad_accum} must be 1 with mesh.{PIPELINE}={p}: "
            "the pipeline's parallel.num_microbatches already accumulates"
        )
    layers = model.num_hidden_layers
    # Blocks an end stage runs on its own (`stage.Ends`: DeepSeek-V3's leading dense layers) are in no split.
    staged = facts.staged_layers if facts is not None and facts.staged_layers else layers
    what = f"model.num_hidden_layers={layers}"
    if staged != layers:
        what = f"the {staged} staged layers (model.num_hidden_layers={layers} less those the first stage runs on its own)"
    if split == AUTO:
        if staged < p * v:
            errors.append(
                f"{what} cannot fill mesh.{PIPELINE} × parallel.virtual_stages={p * v} stages (each needs at least one layer)"
            )
    else:
        errors += [f"{key}={list(split)} {problem}" for problem in split_problems(split, staged, p, v, what)]
    if facts is not None and facts.table_uses > 1 and train.mtp_loss_weight > 0 and parallel.pipeline_vocab != "ends":
        errors.append(
            f"multi-token prediction (train.mtp_loss_weight={train.mtp_loss_weight}) with mesh.{PIPELINE}={p} needs "
            "parallel.pipeline_vocab='ends' (its modules run on the last stage with the whole LM head); set it, "
            "or train.mtp_loss_weight=0"
        )
    errors += kind.constraints(p, m, v)  # the schedule's own microbatch constraints
    if has_aux_losses and parallel.zero_stage == 3:
        # ZeRO-3 leaves the batch axes to the partitioner inside the engine, so the expert dispatch
        # would nest its own shard_map over them inside the pipeline's; Shardy rejects that.
        errors.append(
            f"parallel.zero_stage=3 with mesh.{PIPELINE}={p} is not supported for model.model_type="
            f"{model.model_type!r} (expert dispatch inside the pipeline); use parallel.zero_stage 0 or 1"
        )
    # "spread": the embedding and LM head are split by vocab over pipeline × tensor (`vocab.py`).
    vocab, shards = padded_vocab_size(model.vocab_size), p * mesh[TENSOR]
    if parallel.pipeline_vocab == "spread" and vocab % shards:
        errors.append(
            f"padded vocab (model.vocab_size={model.vocab_size} → {vocab}) is not divisible by "
            f"mesh.{PIPELINE} × mesh.{TENSOR}={shards}; change model.vocab_size, mesh.{PIPELINE}, mesh.{TENSOR} "
            "or parallel.pipeline_vocab"
        )
    return errors
