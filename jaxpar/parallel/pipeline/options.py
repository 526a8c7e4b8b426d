"""Pipeline options from `config.parallel` and the model's facts, decided once, and the config checks they need."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jaxpar.axes import DATA, EXPERT, PIPELINE, TENSOR
from jaxpar.model_facts import padded_vocab_size
from jaxpar.parallel.pipeline.balance import AUTO, PLACEMENTS, auto_split, parse_split, split_problems
from jaxpar.parallel.pipeline.schedules import SCHEDULE_NAMES


@dataclass(frozen=True)
class PipelineOptions:
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    num_ranks: int = 1  # mesh.pipeline
    layers: int = 0  # the model's decoder layers
    vocab: str = "spread"  # where embedding / head run: a `balance.PLACEMENTS` entry (see `vocab.py`)
    # `parallel.pipeline_stage_layers`: an explicit split (layers per global stage s = u·p + r,
    # virtual stage u on rank r), or AUTO, balanced from the model's facts at `seq_len`.
    split: tuple | str = AUTO
    facts: object = None  # the model's `jaxpar.model_facts.ModelFacts` (read by AUTO only)
    seq_len: int = 0

    @functools.cached_property
    def stage_layers(self) -> tuple:
        """Layers per global stage: the explicit split, or the auto split, computed when first read
        (a schedule simulation, ~20 ms at 70B: the planner prices thousands of plans and never
        needs it; the rules table reads only `shard_layers`)."""
        if self.split != AUTO:
            return tuple(self.split)
        return auto_split(
            self.facts, self.seq_len, self.schedule, self.num_ranks, self.microbatches, self.virtual_stages,
            placement=self.vocab,
        )

    @property
    def shard_layers(self) -> bool:
        """The [L, ...] layer stacks split over `pipeline` (else replicated: see `layout.py`)."""
        return self.layers % self.num_ranks == 0


def pipeline_options(config, mesh: dict, facts) -> PipelineOptions | None:
    """None when the pipeline axis is 1. `parallel.num_microbatches` 0 means mesh.pipeline."""
    p = mesh[PIPELINE]
    if p == 1:
        return None
    parallel = config.parallel
    return PipelineOptions(
        schedule=parallel.pipeline_schedule,
        microbatches=parallel.num_microbatches or p,
        virtual_stages=parallel.virtual_stages,
        num_ranks=p,
        layers=facts.layers,
        vocab=parallel.pipeline_vocab,
        split=parse_split(parallel.pipeline_stage_layers),
        facts=facts,
        seq_len=config.train.seq_len,
    )


def checks(config, mesh: dict, *, has_aux_losses: bool) -> list[str]:
    """One line per problem, each naming the key to change."""
    parallel, train, model = config.parallel, config.train, config.model
    errors = []
    name, v, m = parallel.pipeline_schedule, parallel.virtual_stages, parallel.num_microbatches
    if name not in SCHEDULE_NAMES:
        errors.append(f"parallel.pipeline_schedule={name!r} is not one of {SCHEDULE_NAMES}")
    if v < 1:
        errors.append(f"parallel.virtual_stages={v} must be >= 1")
    elif v > 1 and name != "interleaved_1f1b":
        errors.append(f"parallel.virtual_stages={v} needs parallel.pipeline_schedule='interleaved_1f1b' (got {name!r})")
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
    if split == AUTO:
        if layers < p * v:
            errors.append(
                f"model.num_hidden_layers={layers} cannot fill mesh.{PIPELINE} × parallel.virtual_stages={p * v} "
                "stages (each needs at least one layer)"
            )
    else:
        errors += [f"{key}={list(split)} {problem}" for problem in split_problems(split, layers, p, v)]
    if name == "interleaved_1f1b" and m % p:
        errors.append(f"parallel.num_microbatches={m} must be a multiple of mesh.{PIPELINE}={p} for interleaved_1f1b")
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
