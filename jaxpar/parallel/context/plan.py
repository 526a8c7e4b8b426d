"""Context parallelism's decisions for one config and mesh (`ContextPlan`), and its config checks.

The plan is None when mesh.context is 1. The rules table (`jaxpar.sharding`) reads it to map the
sequence names (`seq`, `act_seq`) to `context`; the model's attention reads it to pick the
implementation; the loss reads it to put the batch in the sharded order (`sequence.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar import fp8
from jaxpar.axes import CONTEXT, PIPELINE, TENSOR
from jaxpar.parallel.context.local import DEFAULT_BLOCK
from jaxpar.parallel.context.sharded import IMPLS


@dataclass(frozen=True)
class ContextPlan:
    size: int  # mesh.context
    impl: str = "all_gather"  # a key of IMPLS
    load_balance: bool = True  # 2c chunks, rank r holds r and 2c-1-r; else contiguous slices
    block: int = DEFAULT_BLOCK  # query / key chunk of the flash-style kernels
    # all_gather moves the latents keys and values are expanded from (`latent.py`), not K and V.
    latent: bool = False


def context_plan(config, mesh: dict, facts=None) -> ContextPlan | None:
    """`facts`: the model's (`jaxpar.model_facts.ModelFacts`): whether it has latents to gather."""
    if mesh[CONTEXT] == 1:
        return None
    parallel = config.parallel
    latent = parallel.context_impl == "all_gather" and bool(parallel.context_latent) and bool(facts and facts.kv_latent_width)
    # Not with MLA's up-projection in FP8 (`jaxpar.models.deepseek_v3.attention`): each rank's
    # K / V cotangent is a part of the sum, and e5m2 rounds parts unlike their sum.
    latent = latent and not fp8.runs_in_fp8(config.train, "v_proj")
    return ContextPlan(
        latent=latent,
        size=mesh[CONTEXT],
        impl=parallel.context_impl,
        load_balance=bool(parallel.context_load_balance),
        block=parallel.context_block_size,
    )


def sequence_axes(plan: ContextPlan | None) -> tuple:
    """The mesh axes the sequence is split over by context parallelism (empty without it)."""
    return () if plan is None else (CONTEXT,)


def local_kv_heads(model, tensor: int) -> int:
    """KV heads one tensor rank holds after `parallel.tensor.repeat_kv` (at least 1)."""
    kv = model.num_key_value_heads
    return kv // tensor if kv % tensor == 0 else 1


def checks(config, mesh: dict, *, backend: str) -> list[str]:
    """One line per problem, each naming the key to change. `backend`: jax.default_backend()."""
    parallel, train, model = config.parallel, config.train, config.model
    errors = []
    impl = parallel.context_impl
    if impl not in IMPLS:
        errors.append(f"parallel.context_impl={impl!r} is not one of {tuple(IMPLS)}")
    if parallel.context_block_size < 1:
        errors.append(f"parallel.context_block_size={parallel.context_block_size} must be >= 1")
    c = mesh[CONTEXT]
    if c == 1 or errors:
        return errors
    s, t = train.seq_len, mesh[TENSOR]
    if parallel.context_load_balance and s % (2 * c):
        errors.append(
            f"train.seq_len={s} is not divisible by 2 × mesh.{CONTEXT} = {2 * c} (parallel.context_load_balance "
            f"cuts each sequence into 2 × mesh.{CONTEXT} chunks); change train.seq_len or mesh.{CONTEXT}"
        )
    elif s % c:
        errors.append(f"train.seq_len={s} is not divisible by mesh.{CONTEXT}={c}; change train.seq_len or mesh.{CONTEXT}")
    if parallel.sequence_parallel and s % (c * t):
        errors.append(
            f"train.seq_len={s} is not divisible by mesh.{CONTEXT} × mesh.{TENSOR} = {c * t} (sequence_parallel "
            f"splits each context shard over {TENSOR}); change train.seq_len"
        )
    if impl == "all_to_all":
        heads, kv = model.num_attention_heads // t, local_kv_heads(model, t)
        if heads % c:
            errors.append(
                f"parallel.context_impl='all_to_all' needs the {heads} query heads per {TENSOR} rank "
                f"(model.num_attention_heads / mesh.{TENSOR}) divisible by mesh.{CONTEXT}={c}; use 'ring' or 'all_gather'"
            )
        elif kv % c and c % kv:
            errors.append(
                f"parallel.context_impl='all_to_all' needs the {kv} KV heads per {TENSOR} rank to divide or be "
                f"divisible by mesh.{CONTEXT}={c} (model.num_key_value_heads); use 'ring' or 'all_gather'"
            )
    if impl == "ring" and mesh[PIPELINE] > 1 and backend == "cpu":
        # Measured: XLA:CPU's collective-permute waits for every device of the program, and a
        # pipeline stage runs inside a branch only its pipeline rank takes (jax-notes).
        errors.append(
            f"parallel.context_impl='ring' with mesh.{PIPELINE}={mesh[PIPELINE]} deadlocks on XLA:CPU (a ring step "
            f"inside a per-rank pipeline branch); use 'all_gather' or 'all_to_all'"
        )
    # `in`, not ConfigDict.get: a missing key makes `get` build a did-you-mean message first (6 s
    # of the planner's 70B search, which checks 10,000 dense candidates).
    capacity = model.capacity_factor if "capacity_factor" in model else 0.0
    if capacity > 0 and parallel.context_load_balance:
        errors.append(
            f"model.capacity_factor={model.capacity_factor} drops tokens by sequence order, which "
            "parallel.context_load_balance permutes; set parallel.context_load_balance=False or model.capacity_factor=0"
        )
    elif capacity > 0 and mesh[PIPELINE] > 1:
        # Inside the pipeline engine the dispatch runs per device, on this context rank's slice of
        # each sequence; a per-sequence capacity needs the whole sequence.
        errors.append(
            f"model.capacity_factor={model.capacity_factor} with mesh.{CONTEXT}={c} and mesh.{PIPELINE}="
            f"{mesh[PIPELINE]}: per-sequence capacity needs whole sequences inside pipeline stages; "
            "set model.capacity_factor=0 (dropless)"
        )
    return errors
