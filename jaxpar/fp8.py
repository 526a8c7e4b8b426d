"""FP8 training (`train.fp8`): the recipes, which matmuls run in FP8, their config keys and checks.

A recipe is a record that owns its facts: how its scales are made (`jaxpar.kernels.fp8.Scaling`)
and whether it keeps state. All recipes quantize the forward operands to e4m3 and the cotangents
to e5m2, accumulate in fp32 and leave the master weights (and everything else) in
`train.param_dtype`. Which matmuls run in FP8 is data (`train.fp8_matmuls`, names of
`FP8_MATMULS`: the attention projections, the MLP and the experts' matrices, DeepSeek-V3's
multi-token prediction projection); the router, the embedding, the LM head and the norms never do
(their names are not matmuls one can list here).
"""

from __future__ import annotations

from dataclasses import dataclass

from ml_collections import ConfigDict, FrozenConfigDict

from jaxpar.kernels.fp8 import Scaling


@dataclass(frozen=True)
class Recipe:
    name: str
    meaning: str
    scaling: Scaling | None  # None: no FP8 at all
    stateful: bool = False  # keeps an amax history (model state) per matmul


RECIPES = (
    Recipe("none", "every matmul in train.compute_dtype, as without FP8", None),
    Recipe("tensorwise", "current scaling: one scale per operand from its amax now", Scaling.TENSOR),
    Recipe("rowwise", "one scale per row of each operand (amax over the contracted dims), now", Scaling.ROW),
    Recipe("delayed", "one scale per operand from the max of its last train.fp8_amax_history amaxes", Scaling.HISTORY, True),
)
RECIPE_NAMES = tuple(r.name for r in RECIPES)

# The matmuls FP8 may run, by the names the layers give them (`jaxpar.models.layers.SAVED_DOTS`
# for the projections, "experts" for all three expert matrices; multi-head latent attention's
# matrices by the names its activations are saved by, `jaxpar.models.deepseek_v3.attention`;
# "mtp_proj" DeepSeek-V3's multi-token prediction `eh_proj`).
FP8_MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate", "mlp_up", "mlp_down", "experts", "mtp_proj")
NEVER = ("router", "embedding", "lm_head", "norm")

KEYS = dict(
    fp8="none",
    fp8_amax_history=16,
    fp8_matmuls=",".join(FP8_MATMULS),
)
MEANINGS = {
    "train.fp8": "FP8 matmuls: e4m3 forward operands, e5m2 gradients, fp32 accumulation and master weights "
    "(emulated on CPU); the recipe says how scales are made",
    "train.fp8_amax_history": "delayed: how many steps' amaxes each scale is the max of",
    "train.fp8_matmuls": "which matmuls run in FP8, comma-separated, of " + ", ".join(FP8_MATMULS)
    + " (never the router, embeddings, LM head or norms)",
}


# The cost model's matmul parts (`jaxpar.analysis.cost.efficiency.part_shapes`) and the FP8 matmuls
# each is made of: a part is priced at the FP8 peak when all of them run in FP8. Under multi-head
# latent attention "qo" is q (or q_b) and o, "kv" kv_b (v_proj; k_proj listed as for the others),
# "latent" the down-projections q_a (q_proj), kv_a (k_proj) and the prediction modules' eh_proj.
COST_PARTS = {
    "qo": ("q_proj", "o_proj"),
    "kv": ("k_proj", "v_proj"),
    "latent": ("q_proj", "k_proj", "mtp_proj"),
    "mlp": ("mlp_gate", "mlp_up", "mlp_down"),
    "experts": ("experts",),
}


def cost_parts(train) -> frozenset:
    """The cost model's parts that run in FP8 under `train` (empty: none; configs saved before
    `train.fp8` existed have none)."""
    if train.get("fp8", "none") not in RECIPE_NAMES or recipe(train.fp8).scaling is None:
        return frozenset()
    names = set(matmul_names(train))
    return frozenset(part for part, members in COST_PARTS.items() if set(members) <= names)


def recipe(name: str) -> Recipe:
    return next(r for r in RECIPES if r.name == name)


@dataclass(frozen=True)
class Fp8:
    """A run's FP8 setting: the recipe and the matmuls it applies to."""

    recipe: Recipe
    matmuls: frozenset = frozenset(FP8_MATMULS)

    def at(self, name: str) -> Scaling | None:
        """The scaling of matmul `name` (None: it runs in the compute dtype)."""
        return self.recipe.scaling if name in self.matmuls else None


def runs_in_fp8(train, name: str) -> bool:
    """Whether `train` runs matmul `name` in FP8 (configs saved before `train.fp8` existed: no)."""
    if train.get("fp8", "none") not in RECIPE_NAMES or recipe(train.fp8).scaling is None:
        return False
    return name in matmul_names(train)


def matmul_names(train) -> list[str]:
    return [n.strip() for n in str(train.fp8_matmuls).split(",") if n.strip()]


def from_config(train) -> Fp8 | None:
    """The run's setting (None: `train.fp8` none); the config has passed `checks`."""
    chosen = recipe(train.fp8)
    return None if chosen.scaling is None else Fp8(chosen, frozenset(matmul_names(train)))


def with_state(model_config, train):
    """`model_config` carrying `fp8_history` (the amax history length) when the recipe keeps
    state, so the model builds its `jaxpar.models.fp8_state.Fp8History` leaves; else itself."""
    if train.get("fp8", "none") not in RECIPE_NAMES or not recipe(train.fp8).stateful:
        return model_config
    cfg = ConfigDict(model_config.to_dict())
    cfg.fp8_history = int(train.fp8_amax_history)
    return FrozenConfigDict(cfg) if isinstance(model_config, FrozenConfigDict) else cfg


def checks(train) -> list[str]:
    """One line per problem, naming the key."""
    if train.fp8 not in RECIPE_NAMES:
        return [f"train.fp8={train.fp8!r} is not one of {RECIPE_NAMES}"]
    errors = []
    if train.fp8_amax_history < 1:
        errors.append(f"train.fp8_amax_history={train.fp8_amax_history} must be >= 1")
    unknown = [n for n in matmul_names(train) if n not in FP8_MATMULS]
    if unknown:
        errors.append(f"train.fp8_matmuls={train.fp8_matmuls!r} names {unknown}, not among {FP8_MATMULS} "
                      f"({', '.join(NEVER)} never run in FP8)")
    return errors
